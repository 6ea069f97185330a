"""A process's set-up and its children: its log lines carry its rank, a worker dies with its
launcher, a script's children stop with the script, and a set-up that talks: each phase says
what it does and how long it took, and a tool's own output (pip's) is shown only when it fails."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

from titanlite.errors import Stopped, UserError


@contextlib.contextmanager
def phase(who: str, what: str) -> Iterator[None]:
    """`<who>: <what> ... done in <seconds>s` on stderr around the phase (" failed" if it raises)."""
    print(f"{who}: {what} ...", end="", file=sys.stderr, flush=True)
    began = time.perf_counter()
    try:
        yield
    except BaseException:
        print(" failed", file=sys.stderr, flush=True)
        raise
    print(f" done in {time.perf_counter() - began:.0f}s", file=sys.stderr, flush=True)


# The longest a user waits without a line: a long phase says it is still going at this interval.
HEARTBEAT_S = 30.0


@contextlib.contextmanager
def heartbeat(say: Callable[[float], None], every: float = HEARTBEAT_S) -> Iterator[None]:
    """`say(seconds so far)` every `every` seconds while the block runs (from a thread of its
    own: the block may be one long call), so a long phase never looks hung."""
    done = threading.Event()
    began = time.perf_counter()

    def beat() -> None:
        while not done.wait(every):
            say(time.perf_counter() - began)

    thread = threading.Thread(target=beat, daemon=True, name="titanlite-heartbeat")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def quietly(cmd: list[str], failed: str) -> None:
    """Run `cmd` with its output kept back; if it fails, show that output, then one UserError
    (`failed`: what went wrong and what to do)."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(f"\n{done.stdout}{done.stderr}")
        raise UserError(f"{failed} (its output is above)")


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
    """Pass `signum` on to a live child and wait for it; kill it after CHILD_GRACE_S. A second
    stop meanwhile goes on to it too (a launcher then kills its workers at once), and the child
    is still waited for: the script never returns before what it started."""
    if proc.poll() is not None:
        return
    try:  # from the signal on: the child may answer it before the wait begins
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)
        _wait_or_kill(proc)
    except (KeyboardInterrupt, Stopped) as e:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(e.signum if isinstance(e, Stopped) else signal.SIGINT)
        _wait_or_kill(proc)
        raise


def _wait_or_kill(proc: subprocess.Popen) -> None:
    try:
        proc.communicate(timeout=CHILD_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
