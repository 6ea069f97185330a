"""A set-up that talks: each phase says what it does and how long it took, and a tool's own
output (pip's) is shown only when it fails."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from titanlite.errors import UserError


@contextmanager
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


@contextmanager
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
