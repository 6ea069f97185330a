"""Hung and lost ranks: a collective that waits longer than comm.timeout_s stops the run with one
line naming the ranks that did not arrive, instead of hanging forever.

Gloo and NCCL timeouts say that a collective timed out, not which peer never came. So each rank
publishes the step it has reached to the rendezvous store, from a background thread (the loop
never waits on the store); the rank that times out reads them all, and the ranks behind the
others are the ones that did not arrive.

Gloo raises the timeout in the waiting rank, which the trainer turns into that line (exit 4).
NCCL's own watchdog tears the process down at the timeout (after writing the flight recorder's
dump, `flight_recorder_env`), so on CUDA the publishing thread also watches the step: one that
has run for comm.timeout_s prints the same line first.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

logger = logging.getLogger("titanlite")

_KEY = "titanlite/reached/"


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


class Heartbeat:
    """This rank's progress, published to the rendezvous store every `period` seconds when it
    changed; `watch_s` > 0 also prints the lost-rank line when one step runs that long."""

    def __init__(self, timeout_s: float, watch: bool, period: float = 0.5) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout_s = timeout_s
        self.watch = watch
        self.step = 0  # the step this rank has reached (has its batch for); 0: none yet
        self.busy = False  # inside a step (the watch runs only then, not during saves)
        self._since = time.monotonic()
        self._period = period
        self._stop = threading.Event()
        self._store = dist.distributed_c10d._get_default_store() if self.world > 1 else None
        if self._store is not None:
            self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
            self._thread.start()

    def reached(self, step: int) -> None:
        self.step, self.busy, self._since = step, True, time.monotonic()

    def idle(self) -> None:
        """Between steps' work (log, save): not watched."""
        self.busy = False

    def _run(self) -> None:
        published, warned = None, False
        while not self._stop.wait(self._period):
            step = self.step
            try:
                if step != published:
                    self._store.set(f"{_KEY}{self.rank}", str(step))
                    published, warned = step, False
                if (
                    self.watch
                    and self.busy
                    and not warned
                    and time.monotonic() - self._since > self.timeout_s
                ):
                    warned = True
                    print(f"titanlite: stopped: {self.explain(step, 'timeout')}", file=sys.stderr, flush=True)
            except Exception:  # the store is gone (the job is ending): nothing left to publish
                return

    def explain(self, step: int, how: str) -> str:
        """The lost-rank line: which ranks did not reach the step this rank waits in; `how` is
        lost_peer's answer."""
        if how == "lost":  # the peers' heartbeats are up to a period old; let them catch up
            time.sleep(2 * self._period)
        reached = {}
        for r in range(self.world):
            key = f"{_KEY}{r}"
            try:
                reached[r] = int(self._store.get(key)) if self._store.check([key]) else None
            except Exception:
                reached[r] = None
        reached[self.rank] = step  # its own, not the heartbeat's copy
        top = max([s for s in reached.values() if s is not None] + [step])
        behind = {r: s for r, s in reached.items() if s is None or s < top}
        if how == "timeout":
            head = f"a collective waited over comm.timeout_s = {self.timeout_s:g}s at step {top}"
        else:
            head = f"a collective lost its connection to a peer at step {top}"
        if not behind:
            return (
                f"{head}; every rank reached that step, so the wait is inside it (a collective or a "
                "kernel); raise comm.timeout_s if the step is legitimately that slow"
            )
        names = ", ".join(str(r) for r in sorted(behind))
        last = ", ".join(f"{r}: {'none' if s is None else s}" for r, s in sorted(behind.items()))
        return (
            f"{head}: rank(s) {names} did not arrive (last step reached: {last}); look at their logs "
            "in the run folder's logs/ (a hung data read, a dead host, a stuck kernel)"
        )

    def close(self) -> None:
        self._stop.set()
