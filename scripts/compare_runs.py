#!/usr/bin/env python3
"""Compare titanlite runs: overlay any runs, or judge whether layouts give the same curve.

    ./scripts/compare_runs.py RUN [RUN ...] [--out DIR]
    ./scripts/compare_runs.py RUN_A RUN_B [RUN ...] --invariance [--rtol X] [--steps N] [--out DIR]

By default the runs are experiments, whatever their seed, data, batch or learning rate (one run
gives its own figures): prints their layouts, every config key that differs and how each ended
(final, lowest and eval loss), and writes runs.txt, runs.json and runs.png (loss, eval loss,
learning rate and gradient norm against the step) to --out (default: next to RUN,
compare-<A>[-vs-<B>[-vs-<C>]], or compare-<A>-vs-<B>-and-<N>-more). Exit 0; 2 for a folder that is no training run's (it says
which: a rehearsal's, a run's that logged no step, or no run folder at all).

--invariance (implied by --rtol) judges instead: every run against RUN_A over their logged steps
(log every step for a full curve: metrics.log_every = 1). Prints a per-step table (loss, absolute
and relative difference, grad-norm difference, loss dispersion, gradient cosine) and the
verdict; writes table.txt, compare.json and compare.png (curves and the log-scale difference).
--rtol: the largest relative loss difference that still counts as the same curve, at every
step. Default from the runs' dtype: 1e-5 for fp32; for bf16, whose rounding differences compound,
2^-12 (u / 16) per step since the first compared one, at most 2e-2 (7.3e-3 at step 30). The
measurements behind both: titanlite/analysis/tolerance.py.
Exit status: 0 the same curve, 1 the curves part (the first step is named), 2 the runs cannot be
compared (different global batch, seed, data or model; a missing or cut-off metrics file).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.analysis.compare import compare, report  # noqa: E402
from titanlite.analysis.runs import load_run, overview  # noqa: E402
from titanlite.analysis.tolerance import default_tolerance  # noqa: E402
from titanlite.errors import UserError  # noqa: E402
from titanlite.tools.cli import Script  # noqa: E402

SCRIPT = Script("compare_runs", __doc__)
SCRIPT.arg("runs", kind="folder", nargs="+", help="run folders; the first is the reference")
SCRIPT.arg(
    "--invariance", kind="switch", help="judge: the same loss curve as RUN_A, or where it parts"
)
SCRIPT.arg(
    "--rtol",
    kind="float",
    above=0.0,
    at_most=1.0,
    help="(implies --invariance) flat relative loss tolerance (default: 1e-5 fp32; bf16 grows with the step)",
)
SCRIPT.arg(
    "--steps",
    kind="int",
    at_least=1,
    at_most=10**9,
    help="--invariance: compare only the first N steps",
)
SCRIPT.arg("--out", kind="out_folder", help="folder for the table, the JSON and the plot")
SCRIPT.arg(
    "--max-rows",
    kind="int",
    default=60,
    at_least=1,
    at_most=10**6,
    help="rows printed per table (all go to table.txt)",
)


def run(args) -> int:
    judge = args.invariance or args.rtol is not None
    if judge and len(args.runs) < 2:
        raise UserError("--invariance needs at least two run folders: the reference first")
    runs = [load_run(r) for r in args.runs]
    more = f"-and-{len(runs) - 2}-more" if len(runs) > 3 else ""
    out = args.out or runs[0].path.parent / (
        "compare-" + "-vs-".join(r.name for r in runs[: 2 if more else 3]) + more
    )
    if not judge:
        print(overview(runs, out))
        return 0
    rtol = args.rtol if args.rtol is not None else default_tolerance(runs)
    comparisons = [compare(runs[0], other, rtol, args.steps) for other in runs[1:]]
    print(report(comparisons, out, args.max_rows))
    return 0 if all(c.passed for c in comparisons) else 1


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(run, argv)


if __name__ == "__main__":
    sys.exit(main())
