"""tests/fork_model.py with one planted invariance bug, for scripts/check_model.py to name: the
token embeddings are centred on their mean over the microbatch's sequences (batch statistics),
so a sequence's loss depends on which sequences share its microbatch."""

from __future__ import annotations

import torch
from fork_model import ForkArgs, ForkLM, parallelize_fork

from titanlite.models.registry import ModelSpec, register_model


def _centre(_module: torch.nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out - out.mean(dim=0, keepdim=True)


class BatchStatsLM(ForkLM):
    def __init__(self, args: ForkArgs) -> None:
        super().__init__(args)
        self.tokens.register_forward_hook(_centre)


register_model(ModelSpec("fork_batch_stats", BatchStatsLM, {"tiny": ForkArgs()}, parallelize_fork))
