"""What the launcher says of a worker group that failed: the rank that caused it (not one
torchrun stopped after it, nor one that lost it) and why, from the ranks' logs in the run folder
(logs/<launch>-node<k>/attempt_<n>/<local rank>/stderr.log): its one-line error, or a crashed
rank's last lines and its log file; and the line a rank's log lacks when its disk took it."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from titanlite.errors import EXIT_LOST_RANK, EXIT_TRAINING, EXIT_USER

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Exits a restart cannot fix: bad input, a training error, a stop by signal.
NO_RESTART = {EXIT_USER, EXIT_TRAINING, *(128 + s for s in STOP_SIGNALS)}
TAIL_LINES = 20  # a crashed rank's last lines shown, when the console did not show them


def how(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"failed with exit code {exitcode}"


def _attempt(log_dir: Path) -> Path | None:
    """The newest attempt's folder (torchrun makes one per restart of the worker group)."""
    attempts = sorted(log_dir.glob("attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    return attempts[-1] if attempts else None


def stderr_log(log_dir: Path, local_rank: int) -> Path | None:
    attempt = _attempt(log_dir)
    return attempt / str(local_rank) / "stderr.log" if attempt else None


def _logs(log_dir: Path) -> list[Path]:
    attempt = _attempt(log_dir)
    return sorted(attempt.glob("*/stderr.log"), key=lambda p: int(p.parent.name)) if attempt else []


def printed_by(text: str, log_dir: Path, ranks: set[int] | None) -> bool:
    """Whether one of `ranks` (None: any) printed a line holding `text` in this attempt (e.g. an
    error every rank finds alike, which a rank on the console has already shown)."""
    return any(
        text in line
        for log in _logs(log_dir)
        if ranks is None or int(log.parent.name) in ranks
        for line in log.read_text(errors="replace").splitlines()
    )


def said_by_any(log_dir: Path) -> str | None:
    """The last one-line error any rank wrote to its log in this attempt (the ranks stop on the
    same error, distributed.utils.first_error), for a rank whose own log lacks it."""
    for log in _logs(log_dir):
        own = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("titanlite: ")]
        if own:
            return own[-1]
    return None


def cause(failures: dict[int, ProcessFailure], stopped: set[int]) -> tuple[int, ProcessFailure]:
    """The failure that caused the others: a rank that stopped the run itself (bad input, a
    training error, a signal), else one that crashed, before the ranks that then lost it (exit 4),
    and before all of them the ranks torchrun stopped after the first failure (`stopped`, local
    ranks); the earliest among equals."""
    return min(
        failures.items(),
        key=lambda kv: (
            kv[1].local_rank in stopped,
            kv[1].exitcode not in NO_RESTART,
            kv[1].exitcode == EXIT_LOST_RANK,
            kv[1].timestamp,
        ),
    )


def report_failure(e: ChildFailedError, log_dir: Path, shown: set[int] | None, stopped: set[int]) -> int:
    """The exit code for a failed launch, with what the console has not shown: the failed rank's
    one-line error, or a crashed rank's last lines and its log file, for the cause (`cause`;
    `stopped`: the local ranks torchrun stopped after the first failure)."""
    rank, first = cause(e.failures, stopped)
    code = first.exitcode
    log = stderr_log(log_dir, first.local_rank)
    lines = log.read_text(errors="replace").splitlines() if log and log.is_file() else []
    on_console = shown is None or first.local_rank in shown
    if code in NO_RESTART or code == EXIT_LOST_RANK:
        own = [ln for ln in lines if ln.startswith("titanlite: ")]
        if own and not on_console and not printed_by(own[-1], log_dir, shown or set()):
            print(f"[rank{rank}]: {own[-1]}", file=sys.stderr)
        if not own and log is not None and log.is_file():  # its log could not take its line: a full disk
            said = said_by_any(log_dir)
            print(
                said
                or f"titanlite: rank {rank} {how(code)} and its log {log} does not say why; is the disk "
                f"under it full? (df -h {log_dir})",
                file=sys.stderr,
                flush=True,
            )
        return code
    if not on_console:
        for line in lines[-TAIL_LINES:]:
            print(f"[rank{rank}]: {line}", file=sys.stderr)
    said = "its last lines are above" if lines else "it printed nothing"
    print(f"titanlite: rank {rank} {how(code)}; {said}; its full log: {log}", file=sys.stderr, flush=True)
    return 1
