#!/usr/bin/env python3
"""The fault catalogue as a table: every case of tests/faults (bad values, data, Hugging Face
folders, checkpoints, script arguments, the launcher's environment, signals, disks, files
removed under a live run), each run as a user would, one verdict per row:

    HELD   titanlite kept its promise (tests/faults/harness.py says what each promise is)
    BENT   kept in substance, not by the letter (more than one line, not titanlite's line)
    BROKE  not kept: a traceback, another exit code, something written, lost or silently different

    ./scripts/fault_catalogue.py [--cheap] [-k TEXT] [--out DIR] [--nproc 2]

--cheap runs only the cases that must stop before any worker, through the launcher's own code
in this process (a second each). Without it every case runs through ./run_train.sh and the
scripts (about 30 minutes on 2 CPU cores). The mounted cases (a full or tiny disk, a read-only
folder) need root; elsewhere they are SKIPPED and say so. Each case is also a test of its own:
tests/test_catalogue.py (the cheap ones and a few quick runs in CI; `scripts/test.sh
tests/test_catalogue.py --catalogue` runs them all). Exit 0 when every case HELD or was SKIPPED.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv(
    dev=True
)  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from faults import CASES, Catalogue, verdict  # noqa: E402

from titanlite.errors import UserError  # noqa: E402
from titanlite.tools.cli import Script  # noqa: E402

SCRIPT = Script("fault_catalogue", __doc__)
SCRIPT.arg(
    "--cheap", kind="switch", help="only the cases stopped before any worker, in this process"
)
SCRIPT.arg(
    "-k", kind="text", default="", help="only the cases whose family or name holds this text"
)
SCRIPT.arg("--out", kind="out_folder", help="work folder (default: a temporary one, removed after)")
SCRIPT.arg("--nproc", kind="int", default=2, at_least=2, at_most=64, help="ranks of every run")


def run(args) -> int:
    work = args.out or Path(tempfile.mkdtemp(prefix="titanlite-catalogue-"))
    c = Catalogue(work.resolve(), args.nproc, args.cheap)
    chosen = [
        k
        for k in CASES
        if (k.cheap or not args.cheap) and args.k.lower() in f"{k.family} {k.name}".lower()
    ]
    if not chosen:
        raise UserError(
            f"no case matches -k {args.k!r}; see the families and names with --cheap, or drop -k"
        )
    counts = {"HELD": 0, "BENT": 0, "BROKE": 0, "SKIPPED": 0}
    began = time.monotonic()
    for k in chosen:
        start = time.monotonic()
        said, why = verdict(c, k)
        counts[said] += 1
        print(
            f"{said:<7} {time.monotonic() - start:5.1f}s  {k.family:<14} {k.name}{f'  -- {why}' if why else ''}",
            flush=True,
        )
    took = time.monotonic() - began
    print(
        f"{len(chosen)} cases in {took:.0f}s: " + ", ".join(f"{n} {v}" for v, n in counts.items())
    )
    if args.out is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if counts["BROKE"] or counts["BENT"] else 0


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(run, argv)


if __name__ == "__main__":
    sys.exit(main())
