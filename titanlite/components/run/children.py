"""Every process a launch started is gone before the launcher says how the launch ended. The
launcher becomes the subreaper of its descendants (Linux), so the children of a rank that has
ended (its DataLoader workers) become its own; before its last line it waits for every child,
and one still alive STOP_WAIT_S after the launch ended is killed, which the line says."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

STOP_WAIT_S = 30  # how long the launcher waits for its processes to exit before it kills them
_PR_SET_CHILD_SUBREAPER = 36
_POLL_S = 0.05


def adopt_orphans() -> None:
    """This process becomes the parent of every orphan among its descendants (Linux only)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def children(parent: int | None = None) -> list[int]:
    """The live children of `parent` (default: this process); an exited one (a zombie) is gone."""
    parent = os.getpid() if parent is None else parent
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            state, ppid = (d / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(ppid) == parent and state != "Z":
            found.append(int(d.name))
    return found


def reap(
    wait_s: float = STOP_WAIT_S,
    hurry: Callable[[], bool] = lambda: False,
    old: frozenset[int] | set[int] = frozenset(),
) -> list[int]:
    """Wait until this process has no live child but the `old` ones, at most `wait_s` (or until
    `hurry()`: a second stop signal), then SIGKILL those left and wait for them. Returns the
    pids killed."""

    def new() -> list[int]:
        return [pid for pid in children() if pid not in old]

    end = time.monotonic() + wait_s
    while (left := new()) and time.monotonic() < end and not hurry():
        time.sleep(_POLL_S)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + wait_s  # SIGKILL is not refused; a process in the kernel's D state
    while new() and time.monotonic() < end:  # ... exits once its call returns
        time.sleep(_POLL_S)
    return left


def killed_line(pids: list[int], hurried: bool) -> str:
    """What the launcher says of the processes `reap` killed (`hurried`: at a second signal)."""
    listed = ", ".join(map(str, pids))
    when = "at the second signal" if hurried else f"{STOP_WAIT_S}s after the launch ended"
    return f"{len(pids)} process(es) it started (pid {listed}) were still running {when} and were killed"
