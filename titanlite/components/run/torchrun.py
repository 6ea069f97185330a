"""torchrun for the launcher: its arguments from the environment (NGPU, NPROC, NNODES, ...), each
checked (one line, exit 2, before any worker starts), and what the launcher says of a failed
worker group: the rank that caused it and why, from the ranks' logs."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from titanlite.errors import EXIT_LOST_RANK, EXIT_TRAINING, EXIT_USER, UserError
from titanlite.tools.cli import Arg

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

MAX_RANKS = 1024  # ranks on one node; more is a typo, not a machine
VARS = {
    a.flags[0]: a
    for a in (
        Arg(("NGPU",), "int", "GPUs on this node (default: nvidia-smi's count)", at_least=0, at_most=MAX_RANKS),
        Arg(("NPROC",), "int", "ranks on this node (default: NGPU, else 2 CPU ranks)", at_least=1, at_most=MAX_RANKS),
        Arg(("NNODES",), "int", "nodes of the job", at_least=1, at_most=65536),
        Arg(("NODE_RANK",), "int", "this node's index (with NNODES > 1)", at_least=0, at_most=65535),
        Arg(("MASTER_ADDR",), "text", "node 0's address (with NNODES > 1)"),
        Arg(("MASTER_PORT",), "int", "node 0's rendezvous port", at_least=1, at_most=65535),
        Arg(("LOG_RANK",), "text", "local ranks that print, comma-separated (default 0)"),
        Arg(("MAX_RESTARTS",), "int", "restarts of a failed worker group (one node)", at_least=0, at_most=100),
        Arg(("OMP_NUM_THREADS",), "int", "threads per rank (default: the cores / NPROC)", at_least=1, at_most=4096),
        Arg(("TITANLITE_CACHE",), "out_folder", "the tokenizer and data cache (default ~/.cache/titanlite)"),
    )
}  # fmt: skip
# torchrun's own warnings the workers need not repeat (pytorch's FutureWarnings, torchdata's)
WARNINGS = (
    "ignore::FutureWarning,ignore::UserWarning:torchdata.stateful_dataloader.stateful_dataloader"
)


def gpu_count() -> int:
    """GPUs nvidia-smi lists on this node (0 without it)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return sum(line.startswith("GPU") for line in listed.splitlines())


def torchrun_args(environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """torchrun's arguments from the environment (each variable that is set checked: one
    UserError on the first problem), and the variables the workers get."""
    v = {}
    for name, a in VARS.items():
        value = environ.get(name, "").strip()
        if value:  # set and empty is unset, as in a shell's ${NAME:-default}
            v[name] = a.check(value)
    ngpu = v.get("NGPU", gpu_count() if "NPROC" not in v else 0)
    nproc = v.get("NPROC", ngpu or 2)
    nnodes = v.get("NNODES", 1)
    restarts = v.get("MAX_RESTARTS", 0)
    shown = _log_ranks(v.get("LOG_RANK", "0"), nproc)
    node = v.get("NODE_RANK", 0)
    if nnodes > 1:
        if restarts:
            raise UserError(
                "MAX_RESTARTS needs NNODES=1; with several nodes let the scheduler requeue the job (scripts/train.slurm does)"
            )
        if "NODE_RANK" not in v or node >= nnodes:
            raise UserError(
                f"NNODES={nnodes} needs NODE_RANK, this node's index from 0 to {nnodes - 1}"
                + (f" (it is {node})" if "NODE_RANK" in v else "")
            )
        if not v.get("MASTER_ADDR"):
            raise UserError(f"NNODES={nnodes} needs MASTER_ADDR (node 0's address)")
    elif node:
        raise UserError(
            f"NODE_RANK={node} but NNODES is 1; set NNODES to the job's nodes, or unset NODE_RANK"
        )
    if nnodes > 1 or "MASTER_PORT" in v:
        port = v.get("MASTER_PORT", 29500)
        if node == 0:  # where the rendezvous listens
            _check_port_free(port)
        addr = v.get("MASTER_ADDR") or "127.0.0.1"
        rdzv = ["--nnodes", str(nnodes), "--node_rank", str(node), "--master_addr", addr]
        rdzv += ["--master_port", str(port)]
    else:
        rdzv = ["--standalone"]  # a free port, so several runs can share a machine
    args = [*rdzv, "--nproc_per_node", str(nproc), "--max-restarts", str(restarts)]
    args += ["--local-ranks-filter", ",".join(map(str, shown))]
    # CPU ranks share the cores; saying so also silences torchrun's OMP banner
    threads = v.get("OMP_NUM_THREADS", max(1, (os.cpu_count() or 1) // nproc))
    warnings = environ.get("PYTHONWARNINGS", WARNINGS)
    return args, {"OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": warnings}


def _log_ranks(text: str, nproc: int) -> list[int]:
    rank = Arg(("LOG_RANK",), "int", "", at_least=0, at_most=nproc - 1)
    try:
        return sorted({rank.check(p.strip()) for p in text.split(",")})
    except UserError:
        raise UserError(
            f"LOG_RANK is {text!r}; it must name local ranks from 0 to {nproc - 1} (NPROC={nproc}), e.g. 0 or 0,1"
        ) from None


def _check_port_free(port: int) -> None:
    """MASTER_PORT must be free on node 0, where the rendezvous listens."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise UserError(
                f"MASTER_PORT {port} is in use on this machine (another run or service listens there); pick a free port, or unset MASTER_PORT on a single node for a free one"
            ) from None


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
NO_RESTART = {EXIT_USER, EXIT_TRAINING, *(128 + s for s in STOP_SIGNALS)}  # a restart cannot fix
TAIL_LINES = 20  # a crashed rank's last lines shown, when the console did not show them


def how(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"failed with exit code {exitcode}"


def _logs(log_dir: Path) -> dict[int, Path]:
    """Each local rank's stderr.log in the newest attempt (torchrun makes one per restart)."""
    attempts = sorted(log_dir.glob("attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    logs = attempts[-1].glob("*/stderr.log") if attempts else []
    return {int(p.parent.name): p for p in sorted(logs, key=lambda p: int(p.parent.name))}


def printed_by(text: str, log_dir: Path, ranks: set[int] | None) -> bool:
    """Whether one of `ranks` (None: any) printed `text` in this attempt (e.g. an error all found)."""
    logs = _logs(log_dir)
    return any(
        text in logs[r].read_text(errors="replace") for r in logs if ranks is None or r in ranks
    )


def _said(log: Path) -> str | None:
    """The last one-line error a rank wrote to its log."""
    lines = log.read_text(errors="replace").splitlines()
    own = [ln for ln in lines if ln.startswith("titanlite: ")]
    return own[-1] if own else None


def own_stops(log_dir: Path) -> dict[int, int]:
    """The local ranks whose own last line says a stop signal stopped them, with that stop's exit
    code: a rank still on its way out when a peer it left failed (and torchrun then stopped it)
    has no exit code of its own in the failures, but its line is in its log."""
    stops = {}
    for rank, log in _logs(log_dir).items():
        said = _said(log) or ""
        for sig in STOP_SIGNALS:
            if said.startswith(f"titanlite: stopped by {sig.name} "):
                stops[rank] = 128 + sig
    return stops


def cause(
    failures: dict[int, ProcessFailure], stopped: set[int], stops: dict[int, int] | None = None
) -> tuple[int, ProcessFailure]:
    """The failure that caused the others: a rank that stopped the run itself (its exit code or
    its own line, `stops`), else one that crashed, then one that lost a peer (exit 4), last the
    local ranks torchrun then `stopped`."""
    stops = stops or {}
    return min(
        failures.items(),
        key=lambda kv: (
            kv[1].local_rank not in stops,
            kv[1].local_rank in stopped,
            kv[1].exitcode not in NO_RESTART,
            kv[1].exitcode == EXIT_LOST_RANK,
            kv[1].timestamp,
        ),
    )


def report_failure(
    e: ChildFailedError, log_dir: Path, shown: set[int] | None, stopped: set[int]
) -> int:
    """The exit code for a failed launch, with what the console has not shown of its cause: its
    one-line error, or a crashed rank's last lines and its log file."""
    stops = own_stops(log_dir)
    rank, first = cause(e.failures, stopped, stops)
    code = stops.get(first.local_rank, first.exitcode)
    logs = _logs(log_dir)
    log = logs.get(first.local_rank)
    on_console = shown is None or first.local_rank in shown
    if code in NO_RESTART or code == EXIT_LOST_RANK:
        said = _said(log) if log else None
        if said and not on_console and not printed_by(said, log_dir, shown or set()):
            print(f"[rank{rank}]: {said}", file=sys.stderr)
        elif not said and log:  # its log could not take its line (a full disk): another's says
            others = [line for line in map(_said, logs.values()) if line]
            why = f"titanlite: rank {rank} {how(code)} and its log {log} does not say why; is the disk under it full? (df -h {log_dir})"
            print(others[0] if others else why, file=sys.stderr, flush=True)
        return code
    lines = log.read_text(errors="replace").splitlines() if log else []
    if not on_console:
        for line in lines[-TAIL_LINES:]:
            print(f"[rank{rank}]: {line}", file=sys.stderr)
    said = "its last lines are above" if lines else "it printed nothing"
    line = f"titanlite: rank {rank} {how(code)}; {said}; its full log: {log or log_dir}"
    print(line, file=sys.stderr, flush=True)
    return 1
