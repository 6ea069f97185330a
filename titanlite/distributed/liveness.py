"""Hung and lost ranks: a collective that waits longer than comm.timeout_s stops the run with one
line naming the ranks at fault, instead of hanging forever.

Gloo and NCCL timeouts do not say which peer never came. So each rank publishes to the rendezvous
store, from a background thread, the step it reached, its phase in the step and a beat counter
(every BEAT_S). The rank that times out reads them twice, BEAT_S * 2.5 apart, and names the ranks
whose beat stopped (frozen), else those behind the others' step, else those in another phase.
NCCL's watchdog ends the process at the timeout (after the flight recorder's dump), so on CUDA
the thread also prints that line itself once a step has run for about comm.timeout_s.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist
from torch.profiler import record_function

from titanlite.distributed.groups import rehearsing

logger = logging.getLogger("titanlite")

_KEY = "titanlite/reached/"
# The beat counter's period. A rank writes its record when it changes, at most once a heartbeat
# period (0.5 s, the phase moving within a step): at 1,000 ranks up to 2,000 small writes a second.
BEAT_S = 2.0
_current = ["set-up"]  # the phase this rank is in
_on_phase: list[Callable[[str], None]] = []  # fault injection (titanlite.faults)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """This rank is in `name` (published by the heartbeat; a torch.profiler range
    `titanlite.<name>`, which scripts/bench.py's step-time breakdown reads). Also a decorator."""
    before, _current[0] = _current[0], name
    for hook in _on_phase:
        hook(name)
    try:
        with record_function(f"titanlite.{name}"):
            yield
    finally:
        _current[0] = before


def on_phase(hook: Callable[[str], None]) -> Callable[[], None]:
    """Call `hook(name)` as this rank enters each phase (fault injection); returns the call that
    stops it."""
    _on_phase.append(hook)
    return lambda: _on_phase.remove(hook)


_LOST = ("connection reset", "connection closed", "broken pipe", "communicator was aborted")


def lost_peer(e: BaseException) -> str | None:
    """What a collective's error says happened to a peer: "timeout", "lost" (its connection
    broke: the peer died) or None (some other error)."""
    if not isinstance(e, RuntimeError):
        return None
    text = str(e).lower()
    if "timed out" in text or "timeout" in text:
        return "timeout"
    return "lost" if any(k in text for k in _LOST) else None


def lost_in_set_up(e: BaseException) -> str | None:
    """The one line for a collective of the set-up (data preparation, a checkpoint's load) that
    lost a peer or timed out, before any heartbeat step exists; None: some other error."""
    how = lost_peer(e) if dist.is_initialized() and dist.get_world_size() > 1 else None
    if how == "lost":
        return (
            "a collective of the set-up lost its connection to a peer: a rank ended before the "
            "first step (a stop, a failure); its own line says why (the run folder's logs/ keep it)"
        )
    if how == "timeout":
        return (
            "a collective of the set-up waited over comm.timeout_s: a rank is slow or stuck before "
            "the first step (data preparation, a checkpoint's load); its log in the run folder's "
            "logs/ says where"
        )
    return None


def flight_recorder_env(trace_dir: Path, entries: int) -> None:
    """Switch on NCCL's flight recorder before the process group starts: the last `entries`
    collectives of each rank, dumped into `trace_dir`/rank_<r> when a collective times out
    (read them with `python -m torch.distributed.flight_recorder.fr_trace`)."""
    if entries <= 0:
        return
    trace_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(entries))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(trace_dir / "rank_"))


def _last_seen(rank: int, record: tuple[int, int, str] | None) -> str:
    if record is None:
        return f"rank {rank} never seen"
    return f"rank {rank} last seen in {record[2]} of step {record[0]}"


class Heartbeat:
    """This rank's progress, published to the rendezvous store every `period` seconds when it
    changed; with `watch` it also prints the lost-rank line when one step runs that long."""

    def __init__(self, timeout_s: float, watch: bool, period: float = 0.5) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout_s = timeout_s
        self.watch = watch
        self.step = 0  # the step this rank has reached (has its batch for); 0: none yet
        self.busy = False  # inside a step (the watch runs only then, not during saves)
        self._since = time.monotonic()
        self._period = period
        self._stop = threading.Event()
        self._store = None  # one rank, or a rehearsal's fake store: there is no peer to tell
        if self.world > 1 and not rehearsing():
            self._store = dist.distributed_c10d._get_default_store()
            threading.Thread(target=self._run, name="heartbeat", daemon=True).start()

    def ready(self, s) -> None:
        """The trainer's hook (titanlite.tools.hooks): the step has its batch."""
        self.step, self.busy, self._since = s.step, True, time.monotonic()

    def idle(self) -> None:
        """Between steps' work (log, save): not watched."""
        self.busy = False

    def _run(self) -> None:
        published, warned_step, beat, last_beat = None, None, 0, -BEAT_S
        # on CUDA the line must come before NCCL's watchdog ends the process at the timeout, and
        # explain() looks at the beats for 2.5 beats first
        watch_s = max(self.timeout_s - 3 * BEAT_S, self.timeout_s / 2)
        while not self._stop.wait(self._period):
            step, now = self.step, time.monotonic()
            try:
                if now - last_beat >= BEAT_S:
                    beat, last_beat = beat + 1, now
                record = f"{step} {beat} {_current[0]}"
                if record != published:
                    self._store.set(f"{_KEY}{self.rank}", record)
                    published = record
                if self.watch and self.busy and warned_step != step and now - self._since > watch_s:
                    warned_step = step
                    print(
                        f"titanlite: stopped: {self.explain(step, 'timeout')}",
                        file=sys.stderr,
                        flush=True,
                    )
            except Exception:  # the store is gone (the job is ending): nothing left to publish
                return

    def _read(self) -> dict[int, tuple[int, int, str] | None]:
        """Every rank's published (step, beat, phase); None where a rank published nothing."""
        out: dict[int, tuple[int, int, str] | None] = {}
        for r in range(self.world):
            key, out[r] = f"{_KEY}{r}", None
            try:
                if self._store.check([key]):
                    step, beat, where = self._store.get(key).decode().split(" ", 2)
                    out[r] = (int(step), int(beat), where)
            except Exception:  # the store is going away, or a record from another version
                pass
        return out

    def explain(self, step: int, how: str) -> str:
        """The lost-rank line: which ranks keep this rank waiting at `step`, and why (see the
        module doc); `how` is lost_peer's answer."""
        if how == "lost":  # the peers' heartbeats are up to a period old; let them catch up
            time.sleep(2 * self._period)
        first = self._read()
        reached = {r: v[0] if v else None for r, v in first.items()}
        reached[self.rank] = step  # its own, not the heartbeat's copy
        top = max([s for s in reached.values() if s is not None] + [step])
        behind = {r: s for r, s in reached.items() if s is None or s < top}
        if how == "lost":  # a broken connection is a peer that ended, not one still computing
            head = f"a collective lost its connection to a peer at step {top}"
            return f"{head}: {self._ended(first, behind)}"
        head = f"a collective waited over comm.timeout_s = {self.timeout_s:g}s at step {top}"
        # a frozen rank comes first, whether or not it reached the step
        time.sleep(2.5 * BEAT_S)
        second = self._read()
        others = [r for r in range(self.world) if r != self.rank and first[r] and second[r]]
        frozen = [r for r in others if first[r][1] == second[r][1]]
        if frozen:
            where = ", ".join(_last_seen(r, first[r]) for r in frozen)
            return (
                f"{head}: rank(s) {', '.join(map(str, frozen))} stopped responding ({where}; its "
                "heartbeat stopped): a frozen process (SIGSTOP, a debugger, a call stuck holding the "
                "interpreter), which a longer comm.timeout_s would not help; look at it on its host "
                "(py-spy dump --pid <pid> shows where it is)"
            )
        if behind:
            names = ", ".join(str(r) for r in sorted(behind))
            last = ", ".join(
                f"{r}: {'none' if s is None else s}" for r, s in sorted(behind.items())
            )
            return (
                f"{head}: rank(s) {names} did not arrive (last step reached: {last}); look at their logs "
                "in the run folder's logs/ (a hung data read, a dead host)"
            )
        mine = _current[0]
        odd = {r: second[r][2] for r in others if second[r][2] != mine}
        if odd:
            where = ", ".join(f"rank {r} in {p}" for r, p in sorted(odd.items()))
            return (
                f"{head}: rank(s) {', '.join(map(str, sorted(odd)))} are still computing ({where}) while "
                f"this rank waits in {mine}: a stuck kernel or a data loader that never returns; look at "
                "their logs in the run folder's logs/"
            )
        common = Counter(v[2] for v in second.values() if v).most_common(1)
        where = common[0][0] if common else mine
        return (
            f"{head}; every rank reached that step and is alive in {where}, so the wait is inside a "
            "collective; raise comm.timeout_s if the step is legitimately that slow"
        )

    def _ended(
        self, seen: dict[int, tuple[int, int, str] | None], behind: dict[int, int | None]
    ) -> str:
        """A lost connection's cause, said at once (the launcher may stop this rank any moment):
        a peer ended; the likeliest are those behind this step or in another phase than this
        rank's, a few of them named with where they were last seen."""
        mine = _current[0]
        odd = [
            r for r in range(self.world) if r != self.rank and (r in behind or seen[r][2] != mine)
        ]
        where = [_last_seen(r, seen[r]) for r in odd[:8]]
        names = ", ".join(map(str, odd[:8])) + (f" and {len(odd) - 8} more" if len(odd) > 8 else "")
        likely = f", most likely among rank(s) {names} ({'; '.join(where)})" if odd else ""
        return (
            f"a peer ended (it crashed, was killed, or stopped on an error of its own){likely}; the launcher "
            "names it, and its log in the run folder's logs/ says why"
        )

    def close(self) -> None:
        self._stop.set()
