"""Stragglers: which rank the others wait for, and by how much. On a measured step each rank
times its data loading, then waits at a one-value all-reduce as the step starts: the last to
arrive waits least, the others about as long as it is late. This sees lateness built up since the
previous step's last collective (a lower bound for a device slow throughout). CUDA waits are read
from events once complete (Event.query), so a step usually carries the previous measured step's
wait; nothing waits on the host."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from titanlite.config.job_config import Alerts as AlertsConfig
from titanlite.diagnostics.registry import Finding, Point


class Arrival:
    """One rank's clock of its measured steps: data loading time, wait at the start barrier, and
    its step time (host clock between step starts)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.cuda = device.type == "cuda"
        self._token = torch.zeros(1, device=device)
        self._start: float | None = None  # host time the step started
        self._step_s = math.nan
        self._events: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._last_wait = math.nan  # CUDA: the newest wait read from completed events

    def start(self) -> None:
        """As the step starts, before its data is loaded (every step: a host clock read)."""
        now = time.perf_counter()
        self._step_s = now - self._start if self._start is not None else math.nan
        self._start = now

    def arrive(self) -> list[float]:
        """Measured steps, after data loading: the barrier. Returns [load_s, wait_s, step_s] for
        the gather (NaN where not known)."""
        load = time.perf_counter() - self._start if self._start is not None else math.nan
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dist.all_reduce(self._token, group=self.group)
            end.record()
            self._events.append((begin, end))
            while self._events and self._events[0][1].query():  # done: reading them does not wait
                begin, end = self._events.popleft()
                self._last_wait = begin.elapsed_time(end) / 1e3
            wait = self._last_wait
        else:
            t = time.perf_counter()
            dist.all_reduce(self._token, group=self.group)
            wait = time.perf_counter() - t
        return [load, wait, self._step_s]


def lateness(q: Point) -> tuple[int, float, float, float, float] | None:
    """A point's latest rank: (rank, how much later than the others' median wait, that as a share
    of the step time, its data loading time, the others' median one), or None without the times."""
    waits = [(w, r) for r, w in enumerate(q.rank_wait or []) if w is not None]
    loads = q.rank_load or []
    if len(waits) < 2 or not q.step_s:
        return None
    wait, rank = min(waits)
    later = statistics.median(w for w, r in waits if r != rank) - wait
    others = [v for r, v in enumerate(loads) if r != rank and v is not None]
    own = loads[rank] if rank < len(loads) and loads[rank] is not None else math.nan
    return rank, later, later / q.step_s, own, statistics.median(others) if others else math.nan


def slow_rank(
    recent: list[Point], cfg: AlertsConfig, explained: Callable[[str | None, int | None], bool]
) -> Finding | None:
    """One rank reaches the step's start last, persistently and by a margin (module doc), in
    `recent`, the last slow_window measured steps from the first (timing needs no burn-in: a slow
    host is slow from its first step). The figures are the medians over the steps it was last."""
    world = len(recent[-1].rank_wait or [])
    lates = [x for x in (lateness(q) for q in recent[-cfg.slow_window :]) if x is not None]
    if len(lates) < cfg.slow_window:
        return None
    counts = [sum(x[0] == r for x in lates) for r in range(world)]
    top = max(range(world), key=counts.__getitem__)
    if counts[top] < cfg.persist_frac * len(lates) or explained(None, top):
        return None
    later, share, own, rest = (
        statistics.median(col)
        for col in list(zip(*(x for x in lates if x[0] == top), strict=True))[1:]
    )
    if share < cfg.slow_margin:
        return None
    msg = (
        f"rank {top} reached the start of the step last in {counts[top]} of the last {len(lates)} measured "
        f"steps, {1e3 * later:.0f} ms ({100 * share:.0f}% of a step) after the others' median; there its data "
        f"loading took {1e3 * own:.0f} ms, the others' {1e3 * rest:.0f} ms"
    )
    values = {"late_s": later, "share": share, "load_s": own, "others_load_s": rest}
    return Finding("slow_rank", [top], msg, values)
