"""Initial weights that are bitwise identical for every dp degree and mode.

Drawing a sharded parameter from one RNG stream gives each rank the stream's *first* values, so
the full tensor would change with the shard count. Here each parameter gets a generator seeded
from (seed, parameter name), the full tensor is drawn (one parameter of extra memory) and each
rank keeps its shard: the draw never depends on the layout, AC or compile wrappers.

A rehearsal (rank 0 of W on a fake process group) never reads its weights for their values, and
drawing a large model in full costs W times its shard: there each rank draws only its own shard
(`per_shard`).
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

# Wrappers that rename parameters without changing the model: activation checkpointing and
# torch.compile. Init must not depend on them either.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


@torch.no_grad()
def copy_full_(p: torch.Tensor, full: torch.Tensor) -> None:
    """Set parameter `p` (a DTensor shard or a plain tensor) from the full tensor `full`, which
    every rank holds alike: each rank copies its own part, with no communication."""
    if isinstance(p, DTensor):
        shard = distribute_tensor(
            full.to(p.device), p.device_mesh, p.placements, src_data_rank=None
        )
        p.to_local().copy_(shard.to_local())
    else:
        p.copy_(full)


def canonical_name(name: str) -> str:
    """A parameter's name with wrapper prefixes removed: the same with or without AC/compile."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


class ParamInit:
    """Passed to `model.init_weights`; fills parameters of a (possibly sharded) model."""

    def __init__(self, model: nn.Module, seed: int, per_shard: bool = False) -> None:
        self.seed = seed
        self.per_shard = per_shard  # draw each rank's part alone: values depend on the layout
        self._names = {id(p): canonical_name(name) for name, p in model.named_parameters()}

    def _generator(self, p: torch.Tensor) -> torch.Generator:
        name = self._names.get(id(p))
        if name is None:
            raise ValueError("ParamInit was given a tensor that is not a parameter of the model")
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        return torch.Generator(device=p.device).manual_seed(int.from_bytes(digest[:8], "little"))

    def _empty_full(self, p: torch.Tensor) -> torch.Tensor:
        shape = p.to_local().shape if self.per_shard and isinstance(p, DTensor) else p.shape
        return torch.empty(shape, dtype=torch.float32, device=p.device)

    def _fill(self, p: torch.Tensor, values: torch.Tensor) -> None:
        if self.per_shard and isinstance(p, DTensor):
            p.to_local().copy_(values)
        else:
            copy_full_(p, values)

    def normal_(self, p: torch.Tensor, std: float, mean: float = 0.0) -> None:
        self._fill(p, self._empty_full(p).normal_(mean, std, generator=self._generator(p)))

    def trunc_normal_(self, p: torch.Tensor, std: float, cutoff: float = 3.0) -> None:
        """Normal(0, std) truncated to +-cutoff*std."""
        full = self._empty_full(p)
        nn.init.trunc_normal_(
            full, 0.0, std, -cutoff * std, cutoff * std, generator=self._generator(p)
        )
        self._fill(p, full)

    def constant_(self, p: torch.Tensor, value: float) -> None:
        self._fill(p, self._empty_full(p).fill_(value))
