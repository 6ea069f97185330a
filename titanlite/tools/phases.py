"""A set-up that talks: each phase says what it does and how long it took, and a tool's own
output (pip's) is shown only when it fails."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
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


def quietly(cmd: list[str], failed: str) -> None:
    """Run `cmd` with its output kept back; if it fails, show that output, then one UserError
    (`failed`: what went wrong and what to do)."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(f"\n{done.stdout}{done.stderr}")
        raise UserError(f"{failed} (its output is above)")
