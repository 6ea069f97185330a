"""Replica consistency: under DDP and across HSDP's replicas every replica must hold bitwise the
same parameters after every update; silent data corruption, a failing device or an op that is
not deterministic across replicas make them drift, and no loss curve shows it. Every
`replica_check_every` steps each rank hashes its parameters on the device (integer arithmetic,
exact in any order) and all-gathers the hashes; the next log step compares each shard's replicas.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanlite.config.fields import due
from titanlite.distributed.parallel_dims import ParallelDims
from titanlite.distributed.parallelize import unwrap
from titanlite.distributed.param_init import canonical_name

_BITS = 52  # hashes travel as float64 in readback: exact below 2**53
_CHUNK = 1 << 24  # elements hashed at once: bounds the int64 temporaries (128 MiB)
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Odd 64-bit multipliers (splitmix64's), as signed int64: multiplying by an odd number is a
# bijection modulo 2**64, so two different elements never mix to the same value.
_K1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_K2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)


def _shift(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as a tensor of integers of the element's width (a view, not a copy)."""
    return t.view(_INT[t.element_size()])


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A device int64 scalar, below 2**52, hashing `t`'s bytes and their positions: the sum of a
    bijective mix of (element bits + position), modulo 2**64. Reads nothing on the host."""
    flat = as_bits(t.detach().reshape(-1))
    h = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, flat.numel(), _CHUNK):
        x = flat[start : start + _CHUNK].to(torch.int64)
        x = x + torch.arange(start, start + x.numel(), dtype=torch.int64, device=t.device) * _GOLDEN
        x = x ^ _shift(x, 30)
        x = x * _K1
        x = x ^ _shift(x, 27)
        x = x * _K2
        x = x ^ _shift(x, 31)
        h += x.sum()
    return h & ((1 << _BITS) - 1)


def gather(mine: torch.Tensor, ranks: int, group) -> tuple[torch.Tensor, dist.Work]:
    """[ranks, mine.numel()]: every rank's `mine`, gathered asynchronously on `group`."""
    out = torch.empty(ranks, mine.numel(), dtype=mine.dtype, device=mine.device)
    return out, dist.all_gather(list(out.unbind(0)), mine, group=group, async_op=True)


def replica_groups(dims: ParallelDims) -> list[list[int]]:
    """The ranks that hold the same parameters, one list per place on every other axis: the
    mesh's ranks along dp_replicate."""
    ranks = dims.mesh.mesh  # the mesh's ranks, one dimension per axis, dp_replicate first
    return ranks.movedim(0, -1).reshape(-1, dims.layout.dp_replicate).tolist()


@dataclass
class _Pending:
    step: int
    hashes: torch.Tensor  # [world, parameters]
    work: dist.Work


@dataclass
class Drift:
    """Replicas that differ after `step`: the ranks that disagree with their shard's majority
    (every rank of a shard without a majority), and the first parameter that differs."""

    step: int
    ranks: list[int]
    parameter: str


class ReplicaCheck:
    def __init__(self, model: torch.nn.Module, dims: ParallelDims, every: int, group) -> None:
        self.groups = replica_groups(dims)
        self.enabled = every > 0 and dims.layout.dp_replicate > 1
        self.every = every  # diagnostics.replica_check_every
        self.group = group
        self.world, self.split = dims.layout.world, dims.layout.replica_ranks
        named = list(unwrap(model).named_parameters())
        self.names = [canonical_name(n) for n, _ in named]
        self.params = [p for _, p in named]
        self.pending: list[_Pending] = []

    def due(self, step: int) -> bool:
        return self.enabled and due(step, self.every)

    def start(self, step: int) -> None:
        """After the update of `step`: hash this rank's parameters, all-gather the hashes async."""
        mine = torch.stack(
            [fingerprint(p.to_local() if isinstance(p, DTensor) else p) for p in self.params]
        )
        hashes, work = gather(mine, self.world, self.group)
        self.pending.append(_Pending(step, hashes, work))

    def take(self) -> list[_Pending]:
        """The pending checks, their gathers completed; the caller reads their hashes."""
        out, self.pending = self.pending, []
        for p in out:
            p.work.wait()
        return out

    def compare(self, step: int, hashes: list[list[float]]) -> Drift | None:
        """Host side: hashes[rank][parameter] as read back."""
        odd: set[int] = set()
        first = len(self.names)
        for ranks in self.groups:
            rows = [tuple(hashes[r]) for r in ranks]
            top, n = Counter(rows).most_common(1)[0]
            if n == len(rows):
                continue
            majority = top if 2 * n > len(rows) else None
            for r, row in zip(ranks, rows, strict=True):
                if row == majority:
                    continue
                odd.add(r)
                ref = majority if majority is not None else next(o for o in rows if o != row)
                differs = (i for i, (a, b) in enumerate(zip(row, ref, strict=True)) if a != b)
                first = min(first, next(differs))
        if not odd:
            return None
        # the diagnostics name data-parallel replicas: a rank's is rank // its replica's ranks
        return Drift(step, sorted({r // self.split for r in odd}), self.names[first])
