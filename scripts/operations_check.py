#!/usr/bin/env python3
"""Re-run the moments around a run that operations meet, through ./run_train.sh as a user would,
and print what each one did: exit code, the lines titanlite printed, tracebacks, what was left.

    ./scripts/operations_check.py [--out DIR] [--nproc 2] [-- extra overrides]

Cases: Ctrl-C at step 7; a second Ctrl-C; kill -9 of the launcher's process group, then the same
command; a second launch on a live run folder; a checkpoint.folder of another run; a changed lr
on resume; an unwritable dump folder; a checkpoint.folder that is a file; a worker SIGKILLed
with LOG_RANK=0; a rank that hangs (comm.timeout_s = 5). The tests check each of these; this
script shows them side by side, with timings, on any machine (CPU or GPUs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.components.run.torchrun import MAX_RANKS  # noqa: E402
from titanlite.tools.cli import Script  # noqa: E402

SMALL = [
    "--training.seq_len",
    "128",
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "4",
]
SMALL += [
    "--metrics.log_every",
    "1",
    "--metrics.enable_tensorboard",
    "false",
    "--diagnostics.enable",
    "false",
]


class Runner:
    def __init__(self, out: Path, nproc: int, extra: list[str]) -> None:
        self.out, self.nproc, self.extra = out, nproc, extra
        self.rows: list[dict] = []

    def start(self, name: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        cmd = [
            "./run_train.sh",
            *SMALL,
            *self.extra,
            "--job.dump_folder",
            str(self.out),
            "--job.run_name",
            name,
        ]
        full_env = {**os.environ, "NPROC": str(self.nproc), **(env or {})}
        return subprocess.Popen(
            [*cmd, *args], cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )  # fmt: skip

    def wait_step(self, name: str, proc: subprocess.Popen, step: int) -> None:
        metrics = self.out / name / "metrics.jsonl"
        while proc.poll() is None:
            if metrics.is_file():
                lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
                if any(r["step"] >= step for r in lines):
                    return
            time.sleep(0.05)

    def record(self, case: str, proc: subprocess.Popen, began: float | None = None) -> dict:
        out, err = proc.communicate(timeout=600)
        # titanlite's own lines: errors, stops, crash reports, and what a resume says
        said = [ln for ln in (out + err).splitlines() if _says(ln)]
        row = {
            "case": case,
            "exit": proc.returncode,
            "seconds": round(time.monotonic() - began, 1) if began else None,
            "tracebacks": (out + err).count("Traceback"),
            "lines": said[-3:],
            "log": out + err,
        }
        self.rows.append(row)
        return row


def _says(line: str) -> bool:
    if line.startswith("[titanlite"):
        return any(k in line for k in ("resume:", "resumed from", "taking over"))
    return "titanlite:" in line


def orphans(out: Path) -> int:
    n = 0
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if b"titanlite.train" in cmd and str(out).encode() in cmd:
            n += 1
    return n


SCRIPT = Script("operations_check", __doc__)
SCRIPT.arg("--out", kind="out_folder", help="dump folder (default: a temporary one)")
SCRIPT.arg(
    "--nproc", kind="int", default=2, at_least=2, at_most=MAX_RANKS, help="ranks of every run"
)
SCRIPT.arg("extra", kind="text", nargs="*", help="overrides for every run (after --)")


def check(a) -> int:
    out = a.out or Path(tempfile.mkdtemp(prefix="titanlite-ops-"))
    r = Runner(out, a.nproc, a.extra)
    long = ("--training.steps", "500", "--checkpoint.every", "5", "--checkpoint.at_end", "true")

    p = r.start("ctrl-c", *long)
    r.wait_step("ctrl-c", p, 7)
    os.killpg(p.pid, signal.SIGINT)
    r.record("Ctrl-C at step 7", p, time.monotonic())
    r.record(
        "same command, --optimizer.lr 1e-3, to step 10",
        r.start("ctrl-c", *long[2:], "--training.steps", "10", "--optimizer.lr", "1e-3"),
    )

    p = r.start("twice", *long)
    r.wait_step("twice", p, 3)
    os.killpg(p.pid, signal.SIGINT)
    time.sleep(0.05)
    os.killpg(p.pid, signal.SIGINT)
    r.record("Ctrl-C twice", p, time.monotonic())

    p = r.start("killed", *long)
    r.wait_step("killed", p, 6)
    second = r.record("second launch on the live run folder", r.start("killed", *long))
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    time.sleep(2)
    second["orphans after kill -9 of the first"] = orphans(out)
    r.record(
        "same command after kill -9 (to step 8)",
        r.start("killed", *long[2:], "--training.steps", "8"),
    )

    other = ("--checkpoint.folder", str(out / "killed" / "checkpoints"))
    r.record("checkpoint.folder of another run", r.start("other", *other))
    blocker = out / "a-file"
    blocker.write_text("")
    r.record("dump folder under a file", r.start("x", "--job.dump_folder", str(blocker / "runs")))
    r.record(
        "checkpoint.folder is a file",
        r.start(
            "y",
            "--checkpoint.every",
            "5",
            "--checkpoint.at_end",
            "true",
            "--checkpoint.folder",
            str(blocker),
        ),
    )
    crash = (
        "--training.steps",
        "50",
        "--faults.sigkill_step",
        "3",
        "--faults.sigkill_rank",
        str(a.nproc - 1),
    )
    r.record("worker SIGKILLed, LOG_RANK=0", r.start("crash", *crash))
    hang = (
        "--training.steps",
        "50",
        "--comm.timeout_s",
        "5",
        "--faults.hang_step",
        "3",
        "--faults.hang_rank",
        "0",
    )
    p = r.start("hang", *hang)
    r.wait_step("hang", p, 2)
    r.record("rank 0 hangs at step 3, comm.timeout_s = 5", p, time.monotonic())

    for row in r.rows:
        extra = {
            k: v
            for k, v in row.items()
            if k not in ("case", "exit", "seconds", "tracebacks", "lines", "log")
        }
        took = f", {row['seconds']} s after the event" if row["seconds"] is not None else ""
        print(
            f"- {row['case']}: exit {row['exit']}{took}, tracebacks {row['tracebacks']}{', ' if extra else ''}"
            + ", ".join(f"{k} {v}" for k, v in extra.items())
        )
        for line in row["lines"]:
            print(f"    {line[:300]}")
    (out / "operations_check.json").write_text(json.dumps(r.rows, indent=1))
    print(f"details (every run's output): {out / 'operations_check.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(check, argv)


if __name__ == "__main__":
    sys.exit(main())
