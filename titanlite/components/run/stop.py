"""Stopping on SIGINT or SIGTERM (Ctrl-C, a scheduler's preemption) without losing work, and on
a failure of what only one rank does (fail()), which every rank then stops for with its line.

The handler only records the signal. Ranks may receive it at different steps, or one rank only,
so they agree on the stop step through a MAX all-reduce of the recorded signal on a gloo group
of their own: started after each step, read after the next one. By then it has long completed,
so reading it costs no wait, and every rank reads the same value after the same step. The
trainer then finishes that step, writes a checkpoint, and exits with 128 + the signal number.
So a stop is agreed at most one step late. Where the host waits anyway (after an eval or a
save, which take seconds, and at the end of the run, the last step and the exports included)
the ranks settle at once: one blocking all-reduce of the flag, so a signal that came during
them stops the run there, never lost, never exit 0.

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

from titanlite.components.run.torchrun import STOP_SIGNALS
from titanlite.distributed.groups import host_group
from titanlite.errors import BEFORE_FIRST_STEP, Stopped, TrainingError

# The flag's value for "a rank failed to write what only it writes" (rank 0: the run folder's
# records): above every signal number, so it wins the MAX, and every rank stops with that line.
FAILED = 1 << 16


class StopSignals:
    def __init__(self) -> None:
        self.received = 0  # the first stop signal's number; 0: none
        self.failure = ""  # this rank's one line of a failure every rank must stop for (fail())
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
            self.group = host_group(timedelta(seconds=timeout_s))
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
        buf = bytearray(self._flag().to_bytes(4, sys.byteorder))
        flag = torch.frombuffer(buf, dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._pending = (work, flag, buf)
        return self._failed_or(agreed)

    def fail(self, line: str) -> None:
        """This rank failed at something only it does (rank 0's writes into the run folder):
        every rank stops at the next settle (a log step's end), with this line."""
        self.failure = self.failure or line

    def _flag(self) -> int:
        return FAILED if self.failure else self.received

    def _failed_or(self, agreed: int) -> int:
        """`agreed`, unless it says a rank failed: then every rank raises that rank's line (sent
        to all, so the one line the launcher shows is the same whichever rank it shows)."""
        if agreed != FAILED:
            return agreed
        if self.group is None:
            raise TrainingError(self.failure)
        lines: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(lines, self.failure or None, group=self.group)
        raise TrainingError(next(line for line in lines if line))  # the lowest failing rank's

    def settle(self) -> int:
        """Every rank, where the host waits anyway: the signal all ranks agree to stop for now
        (0: go on), from one blocking all-reduce of what each has received."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
        if self.group is None:
            return self._failed_or(self._flag())
        buf = bytearray(self._flag().to_bytes(4, sys.byteorder))
        dist.all_reduce(
            torch.frombuffer(buf, dtype=torch.int32), op=dist.ReduceOp.MAX, group=self.group
        )
        return self._failed_or(int.from_bytes(buf, sys.byteorder))

    def finish(self) -> int:
        """Every rank, once the run has done all it does (steps, exports): the stop all agree
        on, if one came after the last poll; from now on a signal changes nothing."""
        agreed = self.settle()
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        return agreed
