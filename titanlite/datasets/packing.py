"""Which SFT records share a packed sequence: best-fit decreasing bin packing.

The plan is a function of the records' lengths and seq_len only, computed the same on every
rank: packs are then sequences like any other, so the sampler's global order (and with it dp
invariance) is unchanged. Best-fit decreasing places each record, longest first, into the
fullest pack it still fits (Johnson et al., "Worst-case performance bounds for simple
one-dimensional packing algorithms", SIAM J. Comput. 1974: at most 11/9 OPT + 1 packs); on
SFT-length records it leaves a few percent of padding.
"""

from __future__ import annotations

import numpy as np


class _FreeSpace:
    """Counts of open packs per free capacity 0..capacity, with the smallest capacity >= x that
    has one in O(log capacity): a Fenwick tree searched by prefix count."""

    def __init__(self, capacity: int) -> None:
        self.size = capacity + 1
        self.tree = [0] * (self.size + 1)
        self.top = 1 << self.size.bit_length()

    def add(self, cap: int, delta: int) -> None:
        i = cap + 1
        while i <= self.size:
            self.tree[i] += delta
            i += i & -i

    def _prefix(self, cap: int) -> int:  # open packs with free capacity < cap
        i, total = cap, 0
        while i > 0:
            total += self.tree[i]
            i -= i & -i
        return total

    def smallest_at_least(self, need: int) -> int | None:
        """The smallest free capacity >= need that some open pack has, or None."""
        k = self._prefix(need) + 1  # the k-th pack in capacity order is the first with >= need
        pos, step = 0, self.top
        while step:
            nxt = pos + step
            if nxt <= self.size and self.tree[nxt] < k:
                pos, k = nxt, k - self.tree[nxt]
            step >>= 1
        return pos if pos < self.size else None  # pos: 0-based capacity of the k-th pack


def best_fit_decreasing(costs: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack items of `costs` (each in 1..capacity) into bins of `capacity`.
    Returns (members, starts): bin b holds items members[starts[b]:starts[b+1]], longest first."""
    order = np.argsort(-np.asarray(costs), kind="stable")
    free = _FreeSpace(capacity)
    open_at: dict[int, list[int]] = {}  # free capacity -> bins with exactly that much
    bins: list[list[int]] = []
    room: list[int] = []
    for item in order.tolist():
        cost = int(costs[item])
        cap = free.smallest_at_least(cost)
        if cap is None:
            b = len(bins)
            bins.append([])
            room.append(capacity)
        else:
            b = open_at[cap].pop()
            free.add(cap, -1)
        bins[b].append(item)
        room[b] -= cost
        if room[b] > 0:
            open_at.setdefault(room[b], []).append(b)
            free.add(room[b], 1)
    starts = np.cumsum([0, *(len(x) for x in bins)], dtype=np.int64)
    members = np.fromiter((i for x in bins for i in x), dtype=np.int64, count=int(starts[-1]))
    return members, starts


def restart_positions(starts: np.ndarray, length: int) -> np.ndarray:
    """Each of `length` slots' position within its document, given the slots where documents
    start (slot 0 always starts one): the RoPE positions and document boundaries of
    titanlite.models.attention."""
    slots = np.arange(length, dtype=np.int64)
    bounds = np.union1d([0], np.asarray(starts, dtype=np.int64))
    return slots - bounds[np.searchsorted(bounds, slots, side="right") - 1]
