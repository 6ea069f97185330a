"""Stopping on SIGINT or SIGTERM without losing work, and on a failure of what only one rank does
(fail()). Ranks may get a signal at different steps, or one rank only: they agree through a MAX
all-reduce of the flag on a gloo group of their own, started after each step and read (complete,
no wait) after the next, so the stop (a checkpoint, exit 128 + the signal) is at most one step
late; where the host waits anyway (an eval, a save, the end) a blocking one settles it at once.
A signal pending since the launcher started the worker is handled once the handler is installed
(before the loop it stops at once); after the loop they are ignored (CPython's finalization
would restore the default action, which kills). A process forked from a rank (a DataLoader or
data-preparation worker) inherits the handler: there it passes the signal on to the rank and does
nothing else, so a stop is the rank's alone, whoever received it."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from titanlite.components.run.torchrun import STOP_SIGNALS
from titanlite.distributed.groups import host_group
from titanlite.distributed.utils import first_error
from titanlite.errors import Stopped, TrainingError, stopped_before_first_step

FAILED = 1 << 16  # the flag of a rank's failure (fail()): above every signal, it wins the MAX


_PYTHONS_HOOK = sys.unraisablehook


def _swallowed(unraisable) -> None:
    """Python's hook for an exception it cannot raise: a stop raised inside an at-fork hook (a
    worker process starting) or a __del__ is not printed; StopSignals.arm() raises it again."""
    if not isinstance(unraisable.exc_value, Stopped):
        _PYTHONS_HOOK(unraisable)


class StopSignals:
    def __init__(self) -> None:
        self.pid = os.getpid()  # the rank's; a forked child passes its signals on to it
        self.received = 0  # the first stop signal's number; 0: none
        self.failure = ""  # this rank's one line of a failure every rank must stop for (fail())
        self.armed = False  # the loop runs: a signal stops after the current step
        self.group: dist.ProcessGroup | None = None
        self._pending: tuple[dist.Work, torch.Tensor, bytearray] | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        sys.unraisablehook = _swallowed
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # a pending one is handled now

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self.pid:  # a forked worker of the rank: the stop is the rank's
            with contextlib.suppress(ProcessLookupError):  # a rank gone has no one to tell
                os.kill(self.pid, signum)
            return
        if self.received:
            return
        self.received = signum
        if not self.armed:
            raise stopped_before_first_step(signum)

    def arm(self, timeout_s: int | None) -> None:
        """Every rank, once, as the loop starts; `timeout_s` None: no agreement between ranks
        (a rehearsal's world is fake). A stop of the set-up that was swallowed stops here."""
        if self.received:
            raise stopped_before_first_step(self.received)
        if timeout_s is not None and dist.get_world_size() > 1:
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
        self._pending = self._reduce(async_op=True)
        return self._failed_or(agreed)

    def fail(self, line: str) -> None:
        """This rank failed at something only it does (rank 0's writes into the run folder):
        every rank stops at the next settle (a log step's end), with this line."""
        self.failure = self.failure or line

    def _reduce(self, async_op: bool) -> tuple[dist.Work, torch.Tensor, bytearray]:
        """The MAX all-reduce of this rank's flag. It lives in a host buffer the tensor shares, read
        as bytes, never through a tensor: the host-sync counters (tools/instrument.py) see no read."""
        flag = FAILED if self.failure else self.received
        buf = bytearray(flag.to_bytes(4, sys.byteorder))
        tensor = torch.frombuffer(buf, dtype=torch.int32)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=async_op)
        return work, tensor, buf

    def _failed_or(self, agreed: int) -> int:
        """`agreed`, unless it says a rank failed: then every rank raises that rank's one line."""
        if agreed != FAILED:
            return agreed
        if self.group is None:
            raise TrainingError(self.failure)
        raise TrainingError(first_error(self.failure or None, self.group))  # the lowest rank's

    def settle(self) -> int:
        """Every rank, where the host waits anyway: the signal all agree to stop for now (0: go on)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
        if self.group is None:
            return self._failed_or(FAILED if self.failure else self.received)
        buf = self._reduce(async_op=False)[2]
        return self._failed_or(int.from_bytes(buf, sys.byteorder))

    def finish(self) -> int:
        """Every rank, once the run has done all it does (steps, exports): the stop all agree
        on, if one came after the last poll; from now on a signal changes nothing."""
        agreed = self.settle()
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        return agreed
