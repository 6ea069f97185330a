"""The exceptions that end a run with one line, never a traceback, and the exit code of each.

exit 2    UserError      bad input: nothing ran, a restart cannot help
exit 3    TrainingError  the run cannot go on: a restart cannot help
exit 4    LostRank       a rank stopped responding: a restart (MAX_RESTARTS) may help
128 + n   Stopped        signal n (SIGINT 130, SIGTERM 143): a checkpoint was written
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
from collections.abc import Iterator

EXIT_USER, EXIT_TRAINING, EXIT_LOST_RANK = 2, 3, 4
# how a stop by signal before the loop ends its line; the launcher then removes what the launch made
BEFORE_FIRST_STEP = "before the first step; nothing was written"


class UserError(Exception):
    """A problem with the user's config, flags or files; the message names it and the fix. Exit 2."""


class TrainingError(Exception):
    """The run cannot go on (a non-finite loss, an alert with on_alert = stop, a failed
    checkpoint save); the message names the cause. Exit 3."""


class LostRank(Exception):
    """A collective waited longer than comm.timeout_s or lost a peer; the message names the
    ranks that did not arrive (titanlite.distributed.liveness). Exit 4: a restart may help."""


class Stopped(Exception):
    """The run stops for a signal (exit 128 + signum); the message is the one line to print."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


def stopped_before_first_step(signum: int) -> Stopped:
    """The stop by signal `signum` before the loop: its line says nothing was written."""
    return Stopped(signum, f"stopped by {signal.Signals(signum).name} {BEFORE_FIRST_STEP}")


ENDINGS = (UserError, TrainingError, LostRank, Stopped)


def exit_code(e: Exception) -> int:
    """The exit code of one of the ENDINGS (see the module doc)."""
    if isinstance(e, Stopped):
        return 128 + e.signum
    if isinstance(e, UserError):
        return EXIT_USER
    return EXIT_TRAINING if isinstance(e, TrainingError) else EXIT_LOST_RANK


def report(e: Exception) -> int:
    """Print `e`'s one line to stderr; returns its exit code (see the module doc)."""
    code = exit_code(e)
    if isinstance(e, Stopped):
        line = f"titanlite: {e}"
    elif isinstance(e, UserError):
        line = f"titanlite: error: {e}"
    else:
        line = f"titanlite: stopped: {e}"
    # a worker's stderr is its log in the run folder: a full disk may take the line, not the code
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)
    return code


def first_line(e: BaseException) -> str:
    """An exception's first message line, for one-line errors (its type when it has no message)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# Set (to anything) to see the traceback behind a one-line error from code or files titanlite
# does not own (`foreign`); a worker's also lands in its log in the run folder.
TRACEBACK_ENV = "TITANLITE_TRACEBACK"


@contextlib.contextmanager
def foreign(origin: str, fix: str) -> Iterator[None]:
    """The boundary to what titanlite does not own (a fork's code, a file a script reads): any
    exception or exit inside becomes one UserError naming `origin`, what it raised, and `fix`."""
    try:
        yield
    except ENDINGS:
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the boundary: anything a user's code raises
        if os.environ.get(TRACEBACK_ENV):
            traceback.print_exc()
        what = f"raised {type(e).__name__}: {first_line(e)}"
        if isinstance(e, SystemExit):
            what = f"exited with code {e.code}"
        raise UserError(
            f"{origin} {what}; {fix} (set {TRACEBACK_ENV}=1 for its traceback)"
        ) from None
