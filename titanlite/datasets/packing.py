"""Which SFT records share a packed sequence: best-fit decreasing bin packing, a function of the
records' lengths and seq_len only, so every rank computes the same packs and the sampler orders
them as any sequences. Each record, longest first, goes into the fullest pack it still fits
(Johnson et al., "Worst-case performance bounds for simple one-dimensional packing algorithms",
SIAM J. Comput. 1974: at most 11/9 OPT + 1 packs).
"""

from __future__ import annotations

import bisect

import numpy as np


def best_fit_decreasing(costs: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack items of `costs` (each in 1..capacity) into bins of `capacity`.
    Returns (members, starts): bin b holds items members[starts[b]:starts[b+1]], longest first."""
    order = np.argsort(-np.asarray(costs), kind="stable")
    open_at: dict[int, list[int]] = {}  # free capacity -> open bins with exactly that much
    free: list[int] = []  # the free capacities some open bin has, sorted (at most `capacity`)
    bins: list[list[int]] = []
    room: list[int] = []
    for item in order.tolist():
        cost = int(costs[item])
        at = bisect.bisect_left(free, cost)  # the fullest bin it fits
        if at == len(free):
            b = len(bins)
            bins.append([])
            room.append(capacity)
        else:
            b = open_at[free[at]].pop()
            if not open_at[free[at]]:
                free.pop(at)
        bins[b].append(item)
        room[b] -= cost
        if room[b] > 0:
            if not open_at.get(room[b]):
                bisect.insort(free, room[b])
            open_at.setdefault(room[b], []).append(b)
    starts = np.cumsum([0, *(len(x) for x in bins)], dtype=np.int64)
    members = np.fromiter((i for x in bins for i in x), dtype=np.int64, count=int(starts[-1]))
    return members, starts


def restart_positions(starts: np.ndarray, length: int) -> np.ndarray:
    """Each of `length` slots' position within its document, given the slots where documents
    start (slot 0 always starts one): the RoPE positions and document boundaries of attention."""
    slots = np.arange(length, dtype=np.int64)
    bounds = np.union1d([0], np.asarray(starts, dtype=np.int64))
    return slots - bounds[np.searchsorted(bounds, slots, side="right") - 1]
