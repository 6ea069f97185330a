"""Initial weights that are bitwise identical for every dp degree and mode.

Drawing a sharded parameter from one RNG stream gives each rank the stream's *first* values, so
the full tensor would change with the shard count. Here each parameter gets a generator seeded
from (seed, parameter name), the full tensor is drawn (one parameter of extra memory) and each
rank keeps its shard: the draw never depends on the layout, AC or compile wrappers.
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

    def __init__(self, model: nn.Module, seed: int) -> None:
        self.seed = seed
        self._names = {id(p): canonical_name(name) for name, p in model.named_parameters()}

    def _generator(self, p: torch.Tensor) -> torch.Generator:
        name = self._names.get(id(p))
        if name is None:
            raise ValueError("ParamInit was given a tensor that is not a parameter of the model")
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        return torch.Generator(device=p.device).manual_seed(int.from_bytes(digest[:8], "little"))

    def _empty_full(self, p: torch.Tensor) -> torch.Tensor:
        return torch.empty(p.shape, dtype=torch.float32, device=p.device)

    def normal_(self, p: torch.Tensor, std: float, mean: float = 0.0) -> None:
        full = self._empty_full(p).normal_(mean, std, generator=self._generator(p))
        copy_full_(p, full)

    def trunc_normal_(self, p: torch.Tensor, std: float, cutoff: float = 3.0) -> None:
        """Normal(0, std) truncated to +-cutoff*std."""
        full = self._empty_full(p)
        nn.init.trunc_normal_(
            full, 0.0, std, -cutoff * std, cutoff * std, generator=self._generator(p)
        )
        copy_full_(p, full)

    def constant_(self, p: torch.Tensor, value: float) -> None:
        copy_full_(p, self._empty_full(p).fill_(value))
