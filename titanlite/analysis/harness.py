"""Many Trainers in one torchrun: one process group per world size, the cases looped inside it
(starting torchrun costs seconds; the benchmark, fault scenarios and golden curves pay it once).
The script launches itself (`launch`), each rank builds its Trainers (`trainers`), `finish` ends."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from titanlite.errors import UserError
from titanlite.tools.process import run_child

REPO = Path(__file__).resolve().parents[2]


def torchrun_command(nproc: int, *args: str, launcher: str = "torch.distributed.run") -> list[str]:
    """`torchrun --standalone --nproc_per_node nproc ARGS` with this interpreter: how every script
    and test starts ranks on this machine (`launcher` "titanlite.launch": run_train.sh's own)."""
    return [sys.executable, "-m", launcher, "--standalone", f"--nproc_per_node={nproc}", *args]


def launch(
    nproc: int,
    argv: list[str],
    env: dict | None = None,
    say: Callable[[float], None] | None = None,
    cwd: str | Path = REPO,
) -> subprocess.CompletedProcess:
    """`torchrun_command(nproc, *argv)` (a script and its arguments, or -m and a module's) from
    `cwd`, one thread per rank, output captured, `say` heartbeats
    (titanlite.tools.process.run_child)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    return run_child(torchrun_command(nproc, *map(str, argv)), cwd=cwd, env=full_env, say=say)


def check(proc: subprocess.CompletedProcess, what: str, logs: str = "") -> None:
    """A failed launch as one UserError: the workers' own error line, else the exception a rank
    raised (not torchrun's ChildFailedError, which wraps it), else their last line."""
    if proc.returncode == 0:
        return
    lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("titanlite: error")]
    raised = [line for line in lines if "Error" in line and "ChildFailedError" not in line]
    last = (errors or raised or lines or ["it printed nothing"])[-1]
    raise UserError(
        f"{what} failed (exit {proc.returncode}): {last}"
        + (f"; their logs: {logs}" if logs else "")
    )


def trainers(
    cases: Iterable[tuple[str, list[str]]], each: Callable[[str, Any], Any]
) -> dict[str, Any]:
    """Inside the torchrun: per (name, trainer argv) a Trainer, `each(name, trainer)`'s result,
    the Trainer closed before the next one is built."""
    from titanlite.config import parse_args
    from titanlite.train import Trainer

    out = {}
    for name, argv in cases:
        trainer = Trainer(parse_args(argv)[0])
        try:
            out[name] = each(name, trainer)
        finally:
            trainer.close()
    return out


def is_first_rank() -> bool:
    import torch.distributed as dist

    return dist.get_rank() == 0


def finish() -> None:
    """The end of a worker: the process group destroyed (torchrun's ranks exit cleanly)."""
    import torch.distributed as dist

    dist.destroy_process_group()
