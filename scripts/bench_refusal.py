#!/usr/bin/env python3
"""How long a typo waits for its one line: each mistake below typed to ./run_train.sh as a user
would, timed as a whole process (the shell script, the interpreter's start, the check, the
exit), beside the bare interpreter and the interpreter importing torch, which the launcher's
check comes before.

    ./scripts/bench_refusal.py [--rounds 5]

Every case must exit 2 with one `titanlite: error:` line. Prints each case's median, min and
max wall seconds over --rounds runs, then the launcher's slowest imports on that path
(`python -X importtime`, cumulative): what a typo's answer costs on this machine.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.tools.cli import Script  # noqa: E402

CASES = {
    "a section's typo": ["--traning.steps", "3"],
    "a key's typo": ["--training.stpes", "3"],
    "a value of the wrong type": ["--training.steps", "three"],
    "a missing config": ["--config", "no-such-config.toml"],
    "a missing data file": ["--data.path", "no-such-data.txt"],
}
# what the launcher imports before its first look at the words (titanlite/launch.py)
FIRST_LOOK = "import titanlite.errors, titanlite.config.command_line, titanlite.datasets.spec"

SCRIPT = Script("bench_refusal", __doc__)
SCRIPT.arg("--rounds", kind="int", default=5, at_least=1, at_most=100, help="runs of each case")


def timed(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    return time.perf_counter() - start, done


def slowest_imports(python: str, code: str, n: int = 6) -> list[tuple[float, str]]:
    """The `n` imports of `code` with the largest cumulative time, in seconds."""
    done = subprocess.run(
        [python, "-X", "importtime", "-c", code], cwd=REPO, capture_output=True, text=True
    )
    rows: dict[str, float] = {}
    for line in done.stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            module = parts[2].strip()
            rows[module] = max(rows.get(module, 0.0), int(parts[1]) / 1e6)
    return sorted(((s, m) for m, s in rows.items()), reverse=True)[:n]


def run(args) -> int:
    python = sys.executable  # the project's (use_project_venv), as run_train.sh's
    rows = {}
    for name, words in CASES.items():
        times = []
        for _ in range(args.rounds):
            seconds, done = timed([str(REPO / "run_train.sh"), *words])
            lines = done.stderr.strip().splitlines()
            if (
                done.returncode != 2
                or len(lines) != 1
                or not lines[0].startswith("titanlite: error:")
            ):
                print(f"{name}: exit {done.returncode}, not one refusal line:\n{done.stderr}")
                return 1
            times.append(seconds)
        rows[name] = times
    for what, code in (("python -c pass", "pass"), ("python -c 'import torch'", "import torch")):
        rows[f"{what} (for scale)"] = [timed([python, "-c", code])[0] for _ in range(args.rounds)]
    print(f"{'case':<36} {'median s':>9} {'min s':>7} {'max s':>7}   ({args.rounds} runs each)")
    for name, times in rows.items():
        print(f"{name:<36} {statistics.median(times):>9.2f} {min(times):>7.2f} {max(times):>7.2f}")
    print("\nthe launcher's first look, slowest imports (cumulative s):")
    for seconds, module in slowest_imports(python, FIRST_LOOK):
        print(f"  {seconds:6.3f}  {module}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(run, argv)


if __name__ == "__main__":
    sys.exit(main())
