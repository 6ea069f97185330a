"""Compare training runs step by step: is it the same loss curve, and if not, where does it part.
Two runs are comparable only if they train the same thing (IDENTITY_KEYS, the rule a checkpoint
resumes under); layout settings (LAYOUT) are what an invariance comparison varies; any other
difference is reported, and the verdict (titanlite.analysis.tolerance) says whether it mattered.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from titanlite.analysis.localize import GradientCheck, gradient_check
from titanlite.analysis.runs import Run, differing, pyplot, series, whole_steps
from titanlite.analysis.tolerance import Tolerance, gradient_tolerance
from titanlite.config.fields import IDENTITY_KEYS
from titanlite.errors import UserError
from titanlite.tools.records import fmt

# Expected to differ between the runs of an invariance comparison ("x." is a whole section).
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


@dataclass
class ConfigDiff:
    refused: list[str] = field(default_factory=list)  # identity keys that differ
    changed: list[str] = field(default_factory=list)  # other computation settings that differ
    layout: list[str] = field(default_factory=list)  # layout settings that differ (expected)


def config_diff(a: Run, b: Run) -> ConfigDiff:
    out = ConfigDiff()
    for key, (va, vb) in differing([a, b]):
        line = f"{key}: {va!r} vs {vb!r}"
        if key in IDENTITY_KEYS:
            out.refused.append(line)
        elif any(key == p or (p.endswith(".") and key.startswith(p)) for p in LAYOUT):
            out.layout.append(line)
        else:
            out.changed.append(line)
    for key in ("device", "param_dtype", "reduce_dtype"):
        va, vb = a.resolved.get(key), b.resolved.get(key)
        if va and vb and va != vb:
            out.changed.append(f"resolved {key}: {va!r} vs {vb!r}")
    streams = [
        r.config.get("model.dropout_masks") == "stream"
        for r in (a, b)
        if r.config.get("model.dropout")
    ]
    if out.layout and any(streams):
        out.changed.append(
            "dropout masks from each rank's RNG stream differ between layouts (model.dropout_masks = 'sample' keys them by sequence)"
        )
    return out


def _rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return abs(a - b) / max(abs(a), 1e-30)


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
        """The first curve (the loss, then each term) beyond `tol` or logged by one run only."""
        for name, (a, b) in [("loss", self.loss), *sorted(self.terms.items())]:
            rel = _rel(a, b)
            if (a is None) != (b is None) or (rel is not None and not rel <= tol):
                return name
        return None


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
        """The first step where a curve parts beyond its rtol, or only one run has it."""
        return next((r for r in self.rows if r.parted(self.rtol_at(r))), None)

    @property
    def first_bad_step(self) -> int | None:
        """The first step that fails a verdict: a curve, or the gradient of its step."""
        steps = [self.first_bad.step] if self.first_bad else []
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


def compare(ref: Run, other: Run, rtol: Tolerance | float, steps: int | None = None) -> Comparison:
    """`other` against `ref` step by step (the first `steps` if given): the loss, each loss term,
    and, where both recorded fingerprints, each parameter's reduced gradient. A run that stops
    early is an error, not a silent partial pass."""
    diff = config_diff(ref, other)
    if diff.refused:
        raise UserError(
            f"{ref.name} and {other.name} do not train the same thing, no invariance verdict possible: "
            + "; ".join(diff.refused)
        )
    short = min((ref, other), key=Run.last_step)
    end = steps or max(ref.last_step(), other.last_step())
    if short.last_step() < end:
        raise UserError(
            f"{short.path}: metrics stop at step {short.last_step()}, not {end} (still running, or "
            f"killed?); pass --steps {short.last_step()} to compare the steps both have"
        )
    # a run writes a row per step: a verdict over steps a run lacks is no verdict
    for run in (ref, other):
        lacking = sorted(set(range(1, end + 1)) - set(run.metrics))
        if lacking:
            raise UserError(
                f"{run.path}: metrics.jsonl lacks {len(lacking)} step(s) of 1-{end}, the first {lacking[0]}; compare runs that "
                "hold every step from the first (rerun it, or pass --steps to compare fewer)"
            )
    rows = []
    for s in range(1, end + 1):
        ma, mb = ref.metrics[s], other.metrics[s]
        da, db = ref.diag.get(s, {}), other.diag.get(s, {})
        ta, tb = ma.get("terms") or {}, mb.get("terms") or {}  # a skipped step's are None
        loss = (ma.get("loss"), mb.get("loss"))
        diag = {k: (da.get(k), db.get(k)) for k in DIAG_KEYS}
        terms = {n: (ta.get(n), tb.get(n)) for n in ta.keys() | tb.keys()}
        grad_norm = _rel(ma.get("grad_norm"), mb.get("grad_norm"))
        rows.append(Row(s, loss, _rel(*loss), grad_norm, diag, terms))
    tol = rtol if isinstance(rtol, Tolerance) else Tolerance(rtol)
    gradient = None
    if ref.fingerprints is not None and other.fingerprints is not None:
        limit = gradient_tolerance([ref, other])
        gradient = gradient_check(ref.fingerprints, other.fingerprints, limit)
    return Comparison(ref, other, rows, tol, diff, gradient)


def table(cmp: Comparison, max_rows: int | None = None) -> str:
    """The per-step table; with max_rows, evenly spaced rows plus the first failing one."""
    rows = cmp.rows
    bad = cmp.first_bad.step if cmp.first_bad else None
    if max_rows and len(rows) > max_rows:
        keep = {rows[round(i * (len(rows) - 1) / (max_rows - 1))].step for i in range(max_rows)}
        rows = [r for r in rows if r.step in keep or r.step == bad]
    lines = [
        f"{'step':>6} {'loss ' + cmp.ref.name[:14]:>20} {'loss ' + cmp.other.name[:14]:>20} "
        f"{'abs diff':>10} {'rel diff':>10} {'gnorm rel':>10} {'loss_std A':>11} {'loss_std B':>11} "
        f"{'cos A':>7} {'cos B':>7}"
    ]
    for r in rows:
        (a, b), (sa, sb), (ca, cb) = r.loss, r.diag["loss_std"], r.diag["cos_mean_pairwise"]
        gap = None if a is None or b is None else abs(a - b)
        lines.append(
            f"{r.step:>6} {fmt(a, '.8f'):>20} {fmt(b, '.8f'):>20} "
            f"{fmt(gap, '.2e'):>10} {fmt(r.rel, '.2e'):>10} {fmt(r.grad_norm_rel, '.2e'):>10} "
            f"{fmt(sa, '.5f'):>11} {fmt(sb, '.5f'):>11} {fmt(ca, '.3f'):>7} {fmt(cb, '.3f'):>7}"
            + ("  <- first beyond rtol" if r.step == bad else "")
        )
    return "\n".join(lines)


def describe(cmp: Comparison) -> str:
    """The runs' layouts and how their configs differ."""
    lines = [f"  {n} = {r.path}  [{r.layout}]" for n, r in (("A", cmp.ref), ("B", cmp.other))]
    if cmp.diff.changed:
        changed = "; ".join(cmp.diff.changed)
        lines.append(f"  differs beyond layout (may change the curve): {changed}")
    if cmp.diff.layout:
        lines.append("  layout differences: " + "; ".join(cmp.diff.layout))
    return "\n".join(lines)


def _summary(c: Comparison) -> dict:
    """One comparison as compare.json holds it."""
    rows = [
        {"step": r.step, "loss": list(r.loss), "rel": r.rel, "rtol": c.rtol_at(r)}
        | ({"terms": {n: list(v) for n, v in r.terms.items()}} if r.terms else {})
        for r in c.rows
    ]
    return {
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
        "rows": rows,
    }


def report(comparisons: list[Comparison], out_dir: Path, max_rows: int | None = 60) -> str:
    """Write table.txt, compare.json and compare.png into out_dir; return the console text."""
    out_dir.mkdir(parents=True, exist_ok=True)
    console, full = [], []
    for cmp in comparisons:
        full += [describe(cmp), table(cmp), cmp.verdict(), ""]
        console += [describe(cmp), table(cmp, max_rows), cmp.verdict(), ""]
    (out_dir / "table.txt").write_text("\n".join(full))
    passed = all(c.passed for c in comparisons)
    summary = {"passed": passed, "comparisons": [_summary(c) for c in comparisons]}
    (out_dir / "compare.json").write_text(json.dumps(summary, indent=1))
    plot_invariance(comparisons, out_dir / "compare.png")
    console.append(f"table, JSON and plot: {out_dir}/{{table.txt,compare.json,compare.png}}")
    return "\n".join(console)


def plot_invariance(comparisons: list[Comparison], path: Path) -> None:
    """Every run's loss (top) and its relative difference to the first's against the tolerance."""
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    ref = comparisons[0].ref
    top.plot(*series(ref.metrics, "loss"), label=f"{ref.name} ({ref.layout})", lw=2.5)
    floor = 1e-12  # a zero difference (bitwise equal) has no logarithm: drawn at this floor
    for cmp in comparisons:
        rows = [r for r in cmp.rows if r.loss[1] is not None]
        label = f"{cmp.other.name} ({cmp.other.layout})"
        (line,) = top.plot([r.step for r in rows], [r.loss[1] for r in rows], "--", label=label)
        rel = [r for r in cmp.rows if r.rel is not None]
        values = [max(r.rel, floor) for r in rel]
        style = {"marker": ".", "color": line.get_color(), "label": cmp.other.name}
        bottom.plot([r.step for r in rel], values, **style)
    first = comparisons[0]
    bottom.plot([r.step for r in first.rows], [first.rtol_at(r) for r in first.rows], color="red", ls=":",
                label=f"tolerance ({first.rtol})")  # fmt: skip
    bottom.set_yscale("log")
    ylabel = f"relative loss difference to {ref.name}\n(equal losses drawn at 1e-12)"
    bottom.set_ylabel(ylabel, fontsize=8)
    whole_steps(bottom)
    top.set_ylabel("training loss")
    top.legend(fontsize=7)
    bottom.legend(fontsize=7)
    verdict = "PASS" if all(c.passed for c in comparisons) else "FAIL"
    top.set_title(f"{verdict}: loss curves and their relative difference to {ref.name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
