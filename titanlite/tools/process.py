"""Worker processes die with their launcher."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
AGENT_PID_ENV = "TITANLITE_AGENT_PID"  # set by titanlite.launch: the pid the workers' parent must have


def die_with_parent() -> None:
    """Under torchrun, have the kernel SIGKILL this worker when its launcher dies, however it dies.
    torchrun starts each worker in a session of its own, so a SIGKILL of the launcher's process
    group would otherwise leave the workers training (and checkpointing) as orphans."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    expected = int(os.environ.pop(AGENT_PID_ENV, parent))  # popped: not for runs this one starts
    if parent != expected or os.getppid() != parent:  # the launcher died before the prctl
        os._exit(128 + int(signal.SIGKILL))
