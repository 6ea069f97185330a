"""Any runs side by side, whatever they train: how their configs differ, how each one ended,
and their curves overlaid (scripts/compare_runs.py without --invariance).

Nothing here judges: runs that differ in learning rate, data or seed are experiments, and the
user compares them on purpose. The invariance verdict is titanlite.analysis.compare's.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from titanlite.analysis.plots import plot_runs
from titanlite.analysis.runs import Run
from titanlite.tools.formatting import fmt

# Keys that name or place a run rather than change what it computes.
NAMING = ("job.run_name", "job.dump_folder", "job.description")


def labels(runs: list[Run]) -> list[str]:
    """A, B, C, ... (then A1, B1, ... past 26 runs)."""
    letters = string.ascii_uppercase
    return [letters[i % 26] + (str(i // 26) if i >= 26 else "") for i in range(len(runs))]


def differences(runs: list[Run]) -> list[str]:
    """Every config key whose value is not the same in all runs, with each run's value."""
    names = labels(runs)
    keys = sorted({k for r in runs for k in r.config} - set(NAMING))
    lines = []
    for key in keys:
        values = [r.config.get(key, "<unset>") for r in runs]
        if any(v != values[0] for v in values[1:]):
            lines.append(f"  {key}: " + ", ".join(f"{n} {v!r}" for n, v in zip(names, values, strict=True)))
    return lines


def same_curves(runs: list[Run]) -> list[str]:
    """A line for each run whose training loss equals an earlier run's at every logged step
    (its curve lies on that run's in runs.png, dashed)."""
    names, seen, lines = labels(runs), {}, []
    for name, run in zip(names, runs, strict=True):
        curve = tuple((s, r.get("loss")) for s, r in sorted(run.metrics.items()))
        first = seen.setdefault(curve, name)
        if first != name:
            lines.append(
                f"  {name} has {first}'s training loss at every step (runs.png draws it on {first}'s)"
            )
    return lines


def outcome(run: Run) -> dict:
    """How a run ended: its last logged step and loss, its lowest loss, its last eval."""
    logged = [(s, r["loss"]) for s, r in sorted(run.metrics.items()) if r.get("loss") is not None]
    last_step = max(run.metrics)
    out = {"last_step": last_step, "final_loss": run.metrics[last_step].get("loss")}
    if logged:
        best = min(logged, key=lambda sv: sv[1])
        out.update(min_loss=best[1], min_loss_step=best[0])
    if run.evals:
        step = max(run.evals)
        out.update(eval_loss=run.evals[step].get("loss"), eval_step=step)
    return out


def overview(runs: list[Run], out_dir: Path) -> str:
    """Write runs.txt, runs.json and runs.png into out_dir; return the console text."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names = labels(runs)
    ends = [outcome(r) for r in runs]
    lines = [f"  {n} = {r.path}  [{r.layout}]" for n, r in zip(names, runs, strict=True)]
    diff = differences(runs)
    if len(runs) > 1:
        lines += ["config differences:", *diff] if diff else ["config differences: none"]
    lines.append(
        f"{'run':<4} {'last step':>9} {'final loss':>11} {'lowest loss':>12} {'at step':>8} {'eval loss':>10}"
    )
    for n, e in zip(names, ends, strict=True):
        lines.append(
            f"{n:<4} {e['last_step']:>9} {fmt(e['final_loss'], '.4f'):>11} {fmt(e.get('min_loss'), '.4f'):>12} "
            f"{fmt(e.get('min_loss_step'), 'd'):>8} {fmt(e.get('eval_loss'), '.4f'):>10}"
        )
    lines += same_curves(runs)
    (out_dir / "runs.txt").write_text("\n".join(lines) + "\n")
    record = [{"run": str(r.path), "label": n, **e} for n, r, e in zip(names, runs, ends, strict=True)]
    (out_dir / "runs.json").write_text(json.dumps({"runs": record, "differences": diff}, indent=1))
    plot_runs(runs, out_dir / "runs.png")
    lines.append(f"table, JSON and plot: {out_dir}/{{runs.txt,runs.json,runs.png}}")
    return "\n".join(lines)
