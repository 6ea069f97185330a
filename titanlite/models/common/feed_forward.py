"""The SwiGLU feed-forward (Shazeer, arXiv 2002.05202): w2(silu(w1 x) * w3 x).

w1 (gate) and w3 (up) read the residual stream and w2 (down) writes it, each a plain nn.Linear,
so a tensor-parallel plan can split w1 and w3 by their outputs and w2 by its inputs."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlite.distributed.param_init import ParamInit


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init: ParamInit, out_std: float, up_std: float) -> None:
        """w1 at std 0.02, w2 at `out_std` (the block's depth-scaled std), w3 at `up_std`: Llama's
        reference draws w3 as w2, Qwen's dense layers as w1."""
        init.trunc_normal_(self.w1.weight, 0.02)
        init.trunc_normal_(self.w2.weight, out_std)
        init.trunc_normal_(self.w3.weight, up_std)
