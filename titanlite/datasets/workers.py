"""A DataLoader worker leaves a stop to its rank. A SIGINT or SIGTERM that reaches a worker (a
Ctrl-C of a process group it shares, a scheduler signalling every process, a kill of its pid)
is passed on to the rank it serves, which stops after its step with a checkpoint; the worker
itself goes on serving batches until the rank shuts it down. Without this a worker dies of the
signal (torch's own handler) or raises the rank's stop in itself, and the rank fails with
"DataLoader worker exited unexpectedly" instead of stopping."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

STOPS = {signal.SIGINT, signal.SIGTERM}


def leave_stops_to_parent(worker_id: int) -> None:
    """The loader's worker_init_fn: the stop signals are blocked in the worker and one thread
    waits for them. A SIGTERM from the rank is the loader shutting down a worker that did not
    exit in time: the worker exits at once, as torch's own handler would have it do."""
    rank = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)  # the threads started from now on too

    def wait() -> None:
        while True:
            info = signal.sigwaitinfo(STOPS)
            if info.si_signo == signal.SIGTERM and info.si_pid == rank:
                os._exit(0)
            with contextlib.suppress(ProcessLookupError):  # a rank gone has no one to tell
                os.kill(rank, info.si_signo)

    threading.Thread(target=wait, name="stops-to-rank", daemon=True).start()
