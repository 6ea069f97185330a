"""A process's set-up and its children: its log lines carry its rank, a worker dies with its
launcher, and a script's children stop with the script."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable

from titanlite.tools.phases import heartbeat

_PR_SET_PDEATHSIG = 1
# set by titanlite.launch: the pid the workers' parent must have
AGENT_PID_ENV = "TITANLITE_AGENT_PID"


def init_logging() -> logging.Logger:
    """The "titanlite" logger, on the console with the rank in each line."""
    logger = logging.getLogger("titanlite")
    if not logger.handlers:
        handler = logging.StreamHandler()
        rank = os.environ.get("RANK", "0")
        handler.setFormatter(logging.Formatter(f"[titanlite r{rank}] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


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


# How long a stopped child gets to finish its step and checkpoint before it is killed.
CHILD_GRACE_S = 120


def run_child(
    cmd: list[str], *, cwd=None, env: dict | None = None, say: Callable[[float], None] | None = None
) -> subprocess.CompletedProcess:
    """`cmd` to its end, its output captured; `say(seconds so far)` every HEARTBEAT_S meanwhile.
    The child runs in a session of its own, so a Ctrl-C or SIGTERM of this script reaches it once,
    from here (stop_child): nothing the script started trains on without it."""
    pipe = subprocess.PIPE
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=True
    )
    try:
        with heartbeat(say) if say else contextlib.nullcontext():
            out, err = proc.communicate()
    except BaseException as e:
        stop_child(proc, getattr(e, "signum", signal.SIGINT))
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stop_child(proc: subprocess.Popen, signum: int) -> None:
    """Pass `signum` on to a live child and wait for it; kill it after CHILD_GRACE_S."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signum)
    try:
        proc.communicate(timeout=CHILD_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
