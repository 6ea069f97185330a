"""Finished run folders: each read whole (`load_run`), and any runs side by side whatever they
train (`overview`: config differences, endings, curves overlaid). The overview judges nothing:
runs differing in learning rate or seed are experiments; the verdict is compare's.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titanlite.components.fingerprints import FILE
from titanlite.config.job_config import with_plugins
from titanlite.config.layout import mesh_text
from titanlite.config.manager import to_toml, tomllib
from titanlite.errors import UserError
from titanlite.tools.records import (
    RUN_FOLDER_KINDS,
    fmt,
    folder_kind,
    read_json,
    read_records,
    read_toml,
)


@dataclass
class Run:
    path: Path
    config: dict[str, Any]  # flat "section.key" -> value
    resolved: dict[str, Any]  # run.json: what "auto" and the layout resolved to
    metrics: dict[int, dict]  # step -> metrics record
    diag: dict[int, dict]  # step -> diagnostics record
    evals: dict[int, dict] = field(default_factory=dict)  # step -> held-out eval record
    fingerprints: dict | None = None  # fingerprints.json (debug.fingerprint_step), if written

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def layout(self) -> str:
        r = self.resolved
        mesh = mesh_text(r["mode"], r["dp_replicate"], r["dp_shard"], r.get("axes"))
        return f"{mesh}, local batch {r['local_batch_size']} x accum {r['grad_accum']}, {r['param_dtype']}"

    @property
    def param_dtype(self) -> str:
        return self.resolved["param_dtype"]

    def last_step(self) -> int:
        return max(self.metrics)


def _by_step(path: Path, cut_off: str = "skip") -> dict[int, dict]:
    return {r["step"]: r for r in read_records(path, cut_off=cut_off) if "step" in r}


def load_run(path: str | Path) -> Run:
    """A run folder read whole; a rehearsal's, a run's that logged no step, or anything
    unreadable is one UserError naming the folder or the file."""
    path = Path(path)  # an existing folder: the scripts' arguments are checked at their door
    kind = folder_kind(path)
    if kind != "run":
        raise UserError(
            f"{path} is {RUN_FOLDER_KINDS[kind]}, so it has no training curve; give a training run's folder"
        )
    metrics_file = path / "metrics.jsonl"
    raw = read_toml(path / "config.toml", "a run writes it whole as it starts")
    # A plugin section the run did not name ran at its defaults.
    defaults = tomllib.loads(to_toml(with_plugins()))
    config = {f"{sec}.{k}": v for sec, t in {**defaults, **raw}.items() for k, v in t.items()}
    resolved = read_json(path / "run.json", "it is written as a run starts")
    metrics = _by_step(metrics_file, cut_off="refuse")
    prints = None
    if (path / FILE).is_file():
        prints = read_json(path / FILE, "it is written whole by the run")
    diag, evals = _by_step(path / "diagnostics.jsonl"), _by_step(path / "eval.jsonl")
    return Run(path, config, resolved, metrics, diag, evals, prints)


def differing(runs: list[Run], skip: tuple[str, ...] = ()) -> list[tuple[str, list[Any]]]:
    """(key, each run's value) of every config key not the same in all runs."""
    out = []
    for key in sorted({k for r in runs for k in r.config} - set(skip)):
        values = [r.config.get(key, "<unset>") for r in runs]
        if any(v != values[0] for v in values[1:]):
            out.append((key, values))
    return out


def labels(runs: list[Run]) -> list[str]:
    """A, B, C, ... (then A1, B1, ... past 26 runs)."""
    letters = string.ascii_uppercase
    return [letters[i % 26] + (str(i // 26) if i >= 26 else "") for i in range(len(runs))]


def same_curves(runs: list[Run]) -> list[str]:
    """A line for each run whose training loss is an earlier run's (runs.png draws it on that)."""
    seen: dict[tuple, str] = {}
    lines = []
    for name, run in zip(labels(runs), runs, strict=True):
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
    last_step = run.last_step()
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
    # keys that name or place a run rather than change what it computes are left out
    diff = [
        f"  {key}: " + ", ".join(f"{n} {v!r}" for n, v in zip(names, values, strict=True))
        for key, values in differing(runs, ("job.run_name", "job.dump_folder", "job.description"))
    ]
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
    record = [
        {"run": str(r.path), "label": n, **e} for n, r, e in zip(names, runs, ends, strict=True)
    ]
    (out_dir / "runs.json").write_text(json.dumps({"runs": record, "differences": diff}, indent=1))
    plot_runs(runs, out_dir / "runs.png")
    lines.append(f"table, JSON and plot: {out_dir}/{{runs.txt,runs.json,runs.png}}")
    return "\n".join(lines)


def pyplot() -> Any:
    """matplotlib's pyplot without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def whole_steps(ax: Any) -> None:
    """Whole steps on the x axis (a span of them around a single logged step)."""
    from matplotlib.ticker import MaxNLocator

    lo, hi = ax.get_xlim()
    if hi - lo < 2:
        ax.set_xlim((lo + hi) / 2 - 1, (lo + hi) / 2 + 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")


def series(records: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    steps = sorted(s for s, r in records.items() if r.get(key) is not None)
    return steps, [records[s][key] for s in steps]


# (title, where the values are, key); a panel no run has values for is left out.
PANELS = (
    ("training loss", "metrics", "loss"),
    ("held-out loss (eval)", "evals", "loss"),
    ("learning rate", "metrics", "lr"),
    ("gradient norm (before clipping)", "metrics", "grad_norm"),
)
DASHES = ("-", "--", ":", "-.")  # run i's line style, in turn


def plot_runs(runs: list[Run], path: Path) -> None:
    """Each run's loss, eval loss, learning rate and gradient norm against the step, overlaid."""
    plt = pyplot()
    panels = [p for p in PANELS if any(series(getattr(r, p[1]), p[2])[0] for r in runs)]
    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows), squeeze=False)
    for ax, (title, where, key) in zip(axes.flat, panels, strict=False):
        drawn: dict[tuple, str] = {}  # a curve already drawn -> the run that drew it
        for i, run in enumerate(runs):
            steps, values = series(getattr(run, where), key)
            if not steps:
                continue
            same = drawn.setdefault((tuple(steps), tuple(values)), run.name)
            label = run.name if same == run.name else f"{run.name} (= {same})"
            # each run's own dash, the later ones thinner: a curve equal to another's shows on it
            style = {"ls": DASHES[i % len(DASHES)], "lw": max(0.8, 2.4 - 0.5 * i)}
            ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=label, **style)
        ax.set_title(title, fontsize=10)
        whole_steps(ax)
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
