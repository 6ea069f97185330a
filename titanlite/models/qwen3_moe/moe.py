"""Qwen3-MoE's feed-forward layers: the top-k router and its SwiGLU experts (two ways to run
them, the same sums), and the dense SwiGLU of the layers without experts."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlite.models.common.feed_forward import SwiGLU
from titanlite.models.qwen3_moe.args import Qwen3MoeArgs


class DenseMLP(SwiGLU):
    """The SwiGLU of the layers without experts, returning no router logits."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__(dim, hidden)
        # listed gate, up, down, as transformers lists them: the order named_parameters gives,
        # in which the gradient norm sums the parameters' norms
        self.w2 = self._modules.pop("w2")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return super().forward(x), None


def grouped_mm_available() -> bool:
    return hasattr(F, "grouped_mm")


def runs_grouped(args: Qwen3MoeArgs, dtype: torch.dtype) -> bool:
    """Whether the experts run grouped_mm when they compute in `dtype` (see Experts)."""
    if args.experts_impl != "auto":
        return args.experts_impl == "grouped"
    # bfloat16 only: the dtype grouped_mm's GPU kernels are built for and the only one torch
    # compiles it in (its meta function checks); float32 runs the loop, as do widths whose
    # rows are not a multiple of grouped_mm's 16-byte stride
    aligned = args.dim % 8 == 0 and args.moe_hidden % 8 == 0
    return dtype == torch.bfloat16 and aligned and grouped_mm_available()


class Experts(nn.Module):
    """E SwiGLU experts, stacked as transformers 5 holds them: `gate_up` [E, 2 x hidden, dim]
    (gate rows first) and `down` [E, dim, hidden]. FSDP shards them over the experts.

    Each token's k routing slots are sorted by expert, so each expert reads one contiguous run
    of rows. Two ways to run the runs, the same sums: `loop`, one matmul pair per expert in
    expert order on every rank (an expert with no tokens runs on an empty run, so every
    parameter takes part in every step, as DDP's reducer and FSDP's hooks need; its run lengths
    are read on the host, which is free on a CPU and a sync on a GPU), and `grouped`, two
    grouped_mm calls over all experts with the offsets on the device (no host read). Both compile
    whole (torch.compile(fullgraph=True) takes the host read as data-dependent sizes); grouped_mm
    only in bfloat16, so `auto` takes it where the experts compute in bfloat16 (FSDP's bf16
    parameters, or DDP's bf16 autocast, whose casts grouped_mm, outside autocast's op list, is
    given by hand) on any device, so a CPU rehearsal runs a GPU's path, and the loop elsewhere:
    in float32 the run lengths are read once per MoE layer and microbatch, a device sync where
    the device is a GPU (grouped_mm's own float32 path reads them too)."""

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__()
        self.n = args.experts
        self.gate_up = nn.Parameter(torch.empty(args.experts, 2 * args.moe_hidden, args.dim))
        self.down = nn.Parameter(torch.empty(args.experts, args.dim, args.moe_hidden))
        self.args = args

    @staticmethod
    def compute_dtype(x: torch.Tensor) -> torch.dtype:
        """The dtype the experts' matmuls run in: autocast's where it is on (DDP's bf16)."""
        kind = x.device.type
        return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype

    def grouped(self, x: torch.Tensor) -> bool:
        return runs_grouped(self.args, self.compute_dtype(x))

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, dim], chosen [T, k] expert ids, weights [T, k] -> [T, dim]."""
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # routing slots by expert, token order within one
        rows = x[order // chosen.shape[1]]  # [T x k, dim]
        counts = torch.zeros(self.n, dtype=torch.int64, device=x.device)
        counts.index_add_(0, flat, torch.ones_like(flat))
        if self.grouped(x):
            offsets = counts.cumsum(0).to(torch.int32)
            # autocast's casts, which it does not make for grouped_mm (no-ops outside autocast)
            dt = self.compute_dtype(x)
            gate_up, down = self.gate_up.to(dt).transpose(1, 2), self.down.to(dt).transpose(1, 2)
            gate, up = F.grouped_mm(rows.to(dt), gate_up, offs=offsets).chunk(2, -1)
            out = F.grouped_mm(F.silu(gate) * up, down, offs=offsets)
        else:
            outs = []
            # each expert's weights taken once by unbind: indexing them one by one would give
            # backward a gradient the size of all E experts per expert (quadratic in E)
            runs = rows.split(counts.tolist())
            for run, gate_up, down in zip(
                runs, self.gate_up.unbind(), self.down.unbind(), strict=True
            ):
                gate, up = (run @ gate_up.T).chunk(2, -1)
                outs.append((F.silu(gate) * up) @ down.T)
            out = torch.cat(outs)
        out = out * weights.flatten()[order, None].to(out.dtype)
        # under autocast (DDP's bf16) the loop's matmuls give bf16 while x stays fp32
        return torch.zeros_like(x).index_add_(0, order // chosen.shape[1], out.to(x.dtype))


class MoE(nn.Module):
    """Top-k routing (softmax over the experts in fp32, the k largest, optionally renormalised)
    into the experts. Returns the output and the router logits [B x S, E]."""

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = args.top_k, args.norm_topk_prob
        self.router = nn.Linear(args.dim, args.experts, bias=False)
        self.experts = Experts(args)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.flatten(0, 1)
        logits = self.router(flat)
        top, chosen = logits.float().softmax(-1).topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        out = self.experts(flat, chosen, top.to(x.dtype))
        return out.view_as(x), logits
