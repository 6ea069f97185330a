"""Compare training runs step by step: is it the same loss curve, and if not, where does it part.

Two runs are comparable only if they train the same thing (titanlite.config.fields.IDENTITY_KEYS;
a checkpoint resumes under the same rule). Layout settings (LAYOUT) are what an invariance
comparison varies; anything else that differs (loss normalization, optimizer, precision,
dropout, faults) is reported, and the verdict says whether it mattered: every step's relative
loss difference against the tolerance at that step, a function of the updates since the first
compared step (titanlite.analysis.tolerance); --rtol X sets a flat tolerance.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from titanlite.analysis.localize import GradientCheck, gradient_check
from titanlite.analysis.plots import plot_invariance
from titanlite.analysis.runs import Run
from titanlite.analysis.tolerance import Tolerance, gradient_tolerance
from titanlite.config.fields import IDENTITY_KEYS
from titanlite.errors import UserError
from titanlite.tools.formatting import fmt

# Expected to differ between the runs of an invariance comparison.
LAYOUT = (
    "parallelism.",
    "training.local_batch_size",
    "training.steps",
    "training.activation_checkpoint",
    "training.compile",
    "training.deterministic",
    "diagnostics.",
    "metrics.",
    "job.",
    "checkpoint.",
    "data.cache_dir",
    "data.num_workers",
)


DIAG_KEYS = ("loss_std", "cos_mean_pairwise")


def _matches(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in prefixes)


@dataclass
class ConfigDiff:
    refused: list[str] = field(default_factory=list)  # identity keys that differ
    changed: list[str] = field(default_factory=list)  # other computation settings that differ
    layout: list[str] = field(default_factory=list)  # layout settings that differ (expected)


def config_diff(a: Run, b: Run) -> ConfigDiff:
    out = ConfigDiff()
    for key in sorted(set(a.config) | set(b.config)):
        va, vb = a.config.get(key, "<unset>"), b.config.get(key, "<unset>")
        if va == vb:
            continue
        line = f"{key}: {va!r} vs {vb!r}"
        if key in IDENTITY_KEYS:
            out.refused.append(line)
        elif _matches(key, LAYOUT):
            out.layout.append(line)
        else:
            out.changed.append(line)
    for key in ("device", "param_dtype", "reduce_dtype"):
        va, vb = a.resolved.get(key), b.resolved.get(key)
        if va and vb and va != vb:
            out.changed.append(f"resolved {key}: {va!r} vs {vb!r}")
    streams = [
        r.config.get("model.dropout") and r.config.get("model.dropout_masks") == "stream"
        for r in (a, b)
    ]
    if out.layout and any(streams):
        out.changed.append(
            "dropout masks from each rank's RNG stream differ between layouts (model.dropout_masks = 'sample' keys them by sequence)"
        )
    return out


@dataclass
class Row:
    step: int
    loss: tuple[float | None, float | None]
    rel: float | None  # |a - b| / |a|; None where a loss is missing (skipped step)
    grad_norm_rel: float | None
    diag: dict[str, tuple[float | None, float | None]]
    # each loss term the model adds: name -> (a, b), None where a run has not logged it
    terms: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)

    def parted(self, tol: float) -> str | None:
        """The first curve of this step beyond `tol` (the loss, then each term by name), or
        logged by one run only; None when every curve agrees."""
        for name, (a, b) in [("loss", self.loss), *sorted(self.terms.items())]:
            rel = _rel(a, b)
            if (a is None) != (b is None) or (rel is not None and not rel <= tol):
                return name
        return None

    @property
    def abs(self) -> float | None:
        a, b = self.loss
        return None if a is None or b is None else abs(a - b)


def _steps_text(steps: list[int]) -> str:
    """[1, 2, 3, 7] as "1-3, 7"."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return abs(a - b) / max(abs(a), 1e-30)


@dataclass
class Comparison:
    ref: Run
    other: Run
    rows: list[Row]
    rtol: Tolerance
    diff: ConfigDiff
    gradient: GradientCheck | None = None  # None: a run recorded no fingerprints

    def rtol_at(self, row: Row) -> float:
        return self.rtol.at(row.step - self.rows[0].step)

    @property
    def first_bad(self) -> Row | None:
        """The first step where a curve (the loss, a loss term) parts beyond its rtol, or where
        only one run has it."""
        for row in self.rows:
            if row.parted(self.rtol_at(row)):
                return row
        return None

    @property
    def first_bad_step(self) -> int | None:
        """The first step that fails a verdict: a curve, or the gradient of its step."""
        steps = [r.step for r in (self.first_bad,) if r is not None]
        if self.gradient is not None and not self.gradient.passed:
            steps.append(self.gradient.step)
        return min(steps, default=None)

    @property
    def max_rel(self) -> tuple[float, int]:
        rows = [r for r in self.rows if r.rel is not None]
        if not rows:
            return 0.0, self.rows[0].step
        worst = max(rows, key=lambda r: r.rel if not math.isnan(r.rel) else math.inf)
        return worst.rel, worst.step

    @property
    def passed(self) -> bool:
        return self.first_bad_step is None

    def verdict(self) -> str:
        """The curves' verdict line, then the gradient's (when the runs recorded fingerprints)."""
        worst, at = self.max_rel
        terms = sorted({n for r in self.rows for n in r.terms})
        also = f" (and the loss terms {', '.join(terms)})" if terms else ""
        head = f"{self.other.name} vs {self.ref.name}: {len(self.rows)} steps, max relative loss difference {worst:.3g} (step {at})"
        bad = self.first_bad
        if bad is None:
            line = f"PASS {head}{also} <= rtol {self.rtol}"
        else:
            curve = bad.parted(self.rtol_at(bad))
            a, b = bad.loss if curve == "loss" else bad.terms[curve]
            rel = _rel(a, b)
            why = f"{a} vs {b}" if rel is None else f"{a:.8g} vs {b:.8g}, relative {rel:.3g}"
            what = "" if curve == "loss" else f", loss term {curve}"
            line = f"FAIL {head}; first step beyond rtol {self.rtol_at(bad):.3g}: {bad.step} ({why}{what})"
        if self.gradient is not None:
            return f"{line}\n{self.gradient.line()}"
        lacking = [r.name for r in (self.ref, self.other) if r.fingerprints is None]
        return (
            f"{line}\n(gradient not judged: {' and '.join(lacking)} recorded no fingerprints; "
            "scripts/invariance.py has every run record step 1's)"
        )


def compare(
    ref: Run,
    other: Run,
    rtol: Tolerance | float,
    steps: int | None = None,
    grad_tol: float | None = None,
) -> Comparison:
    """Step-by-step comparison of `other` against `ref` over their common logged steps (the
    first `steps` if given): the loss and every loss term the model adds; and, when both runs
    recorded fingerprints of the same step, every parameter's reduced gradient there, within
    `grad_tol` (default: titanlite.analysis.tolerance's for their dtype). A run that stops early
    is an error, not a silent partial pass."""
    diff = config_diff(ref, other)
    if diff.refused:
        raise UserError(
            f"{ref.name} and {other.name} do not train the same thing, no invariance verdict possible: "
            + "; ".join(diff.refused)
        )
    last = {run.name: run.last_step() for run in (ref, other)}
    short = min((ref, other), key=Run.last_step)
    if (steps is None and len(set(last.values())) > 1) or (
        steps is not None and short.last_step() < steps
    ):
        longest = max(last.values()) if steps is None else steps
        raise UserError(
            f"{short.path}: metrics stop at step {short.last_step()}, not {longest} (still running, or "
            f"killed?); pass --steps {short.last_step()} to compare the steps both have"
        )
    end = short.last_step() if steps is None else steps
    for run in (
        ref,
        other,
    ):  # every step from the first: a verdict over steps a run lacks is no verdict
        lacking = sorted(set(range(1, end + 1)) - set(run.metrics))
        if lacking and run.logs_every_step():
            raise UserError(
                f"{run.path}: metrics.jsonl lacks step(s) {_steps_text(lacking)} of 1-{end}; compare runs that "
                "hold every step from the first (rerun it, or pass --steps to compare fewer)"
            )
    common = sorted(s for s in set(ref.metrics) & set(other.metrics) if s <= end)
    if not common:
        raise UserError(
            f"{ref.name} and {other.name} logged no step in common; log every step (metrics.log_every = 1)"
        )
    rows = []
    for s in common:
        ma, mb = ref.metrics[s], other.metrics[s]
        da, db = ref.diag.get(s, {}), other.diag.get(s, {})
        rows.append(
            Row(
                s,
                (ma.get("loss"), mb.get("loss")),
                _rel(ma.get("loss"), mb.get("loss")),
                _rel(ma.get("grad_norm"), mb.get("grad_norm")),
                {k: (da.get(k), db.get(k)) for k in DIAG_KEYS},
                {
                    n: ((ma.get("terms") or {}).get(n), (mb.get("terms") or {}).get(n))
                    for n in _terms(ma, mb)
                },
            )
        )
    tol = rtol if isinstance(rtol, Tolerance) else Tolerance(rtol)
    gradient = None
    if ref.fingerprints is not None and other.fingerprints is not None:
        limit = grad_tol if grad_tol is not None else gradient_tolerance([ref, other])
        gradient = gradient_check(ref.fingerprints, other.fingerprints, limit)
    return Comparison(ref, other, rows, tol, diff, gradient)


def _terms(a: dict, b: dict) -> set[str]:
    """The loss terms either record holds (a skipped step's are None in both)."""
    return {n for m in (a, b) for n in (m.get("terms") or {})}


def table(cmp: Comparison, max_rows: int | None = None) -> str:
    """The per-step table; with max_rows, evenly spaced rows plus the first failing one."""
    rows = cmp.rows
    if max_rows and len(rows) > max_rows:
        keep = {rows[round(i * (len(rows) - 1) / (max_rows - 1))].step for i in range(max_rows)}
        if cmp.first_bad:
            keep.add(cmp.first_bad.step)
        rows = [r for r in rows if r.step in keep]
    head = (
        f"{'step':>6} {'loss ' + cmp.ref.name[:14]:>20} {'loss ' + cmp.other.name[:14]:>20} "
        f"{'abs diff':>10} {'rel diff':>10} {'gnorm rel':>10} {'loss_std A':>11} {'loss_std B':>11} "
        f"{'cos A':>7} {'cos B':>7}"
    )
    lines = [head]
    bad = cmp.first_bad.step if cmp.first_bad else None
    for r in rows:
        (sa, sb), (ca, cb) = r.diag["loss_std"], r.diag["cos_mean_pairwise"]
        lines.append(
            f"{r.step:>6} {fmt(r.loss[0], '.8f'):>20} {fmt(r.loss[1], '.8f'):>20} "
            f"{fmt(r.abs, '.2e'):>10} {fmt(r.rel, '.2e'):>10} {fmt(r.grad_norm_rel, '.2e'):>10} "
            f"{fmt(sa, '.5f'):>11} {fmt(sb, '.5f'):>11} {fmt(ca, '.3f'):>7} {fmt(cb, '.3f'):>7}"
            + ("  <- first beyond rtol" if r.step == bad else "")
        )
    return "\n".join(lines)


def describe(cmp: Comparison) -> str:
    """The runs' layouts and how their configs differ."""
    lines = [
        f"  A = {cmp.ref.path}  [{cmp.ref.layout}]",
        f"  B = {cmp.other.path}  [{cmp.other.layout}]",
    ]
    if cmp.diff.changed:
        lines.append(
            "  differs beyond layout (may change the curve): " + "; ".join(cmp.diff.changed)
        )
    if cmp.diff.layout:
        lines.append("  layout differences: " + "; ".join(cmp.diff.layout))
    return "\n".join(lines)


def report(comparisons: list[Comparison], out_dir: Path, max_rows: int | None = 60) -> str:
    """Write table.txt, compare.json and compare.png into out_dir; return the console text."""
    out_dir.mkdir(parents=True, exist_ok=True)
    console, full = [], []
    for cmp in comparisons:
        block = [describe(cmp)]
        full += [*block, table(cmp), cmp.verdict(), ""]
        console += [*block, table(cmp, max_rows), cmp.verdict(), ""]
    (out_dir / "table.txt").write_text("\n".join(full))
    summary = {
        "passed": all(c.passed for c in comparisons),
        "comparisons": [
            {
                "ref": str(c.ref.path),
                "other": str(c.other.path),
                "rtol": str(c.rtol),
                "steps": len(c.rows),
                "max_rel": c.max_rel[0],
                "max_rel_step": c.max_rel[1],
                "first_bad_step": c.first_bad_step,
                "passed": c.passed,
                "gradient": None if c.gradient is None else dataclasses.asdict(c.gradient),
                "config_changed": c.diff.changed,
                "layout_changed": c.diff.layout,
                "rows": [
                    {
                        "step": r.step,
                        "loss": list(r.loss),
                        "rel": r.rel,
                        "rtol": c.rtol_at(r),
                        **({"terms": {n: list(v) for n, v in r.terms.items()}} if r.terms else {}),
                    }
                    for r in c.rows
                ],
            }
            for c in comparisons
        ],
    }
    (out_dir / "compare.json").write_text(json.dumps(summary, indent=1))
    plot_invariance(comparisons, out_dir / "compare.png")
    console.append(f"table, JSON and plot: {out_dir}/{{table.txt,compare.json,compare.png}}")
    return "\n".join(console)
