"""Stopping on SIGINT or SIGTERM (Ctrl-C, a scheduler's preemption) without losing work.

The handler only records the signal. Ranks may receive it at different steps, or one rank only,
so they agree on the stop step through a MAX all-reduce of the recorded signal on a gloo group
of their own: started after each step, read after the next one. By then it has long completed,
so reading it costs no wait, and every rank reads the same value after the same step. The
trainer then finishes that step, writes a checkpoint, and exits with 128 + the signal number.

A signal before the loop starts stops at once (there is nothing to save yet). Once a stop is under
way, further signals are ignored here: the launcher answers a second Ctrl-C by killing the workers.
The launcher starts the workers with the stop signals blocked, so one that arrives while a worker
imports torch waits, pending, until the handler is installed here; once the loop has ended they
are ignored (CPython's finalization would otherwise restore the default action, which kills).
"""

from __future__ import annotations

import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from titanlite.errors import BEFORE_FIRST_STEP, Stopped

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    def __init__(self) -> None:
        self.received = 0  # the first stop signal's number; 0: none
        self.armed = False  # the loop runs: a signal stops after the current step
        self.group: dist.ProcessGroup | None = None
        self._pending: tuple[dist.Work, torch.Tensor, bytearray] | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # a pending one is handled now

    def _handle(self, signum: int, frame) -> None:
        if self.received:
            return
        self.received = signum
        if not self.armed:
            raise Stopped(signum, f"stopped by {signal.Signals(signum).name} {BEFORE_FIRST_STEP}")

    def arm(self, timeout_s: int) -> None:
        """Every rank, once, as the loop starts."""
        if dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.armed = True

    def poll(self) -> int:
        """Every rank after every step: the signal all ranks agree to stop for (0: go on)."""
        if self.group is None:
            return self.received
        agreed = 0
        if self._pending is not None:
            work, _, buf = self._pending
            work.wait()  # completed during the step just run
            agreed = int.from_bytes(buf, sys.byteorder)
        # The flag lives in a host buffer the tensor shares: it is read as bytes, never through a
        # tensor, so the host-sync counters (tools/instrument.py) see no read between log steps.
        buf = bytearray(self.received.to_bytes(4, sys.byteorder))
        flag = torch.frombuffer(buf, dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._pending = (work, flag, buf)
        return agreed

    def drain(self) -> None:
        """Every rank, when the loop ends normally: complete the last all-reduce; from now on a
        signal changes nothing (the run has finished its steps)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
