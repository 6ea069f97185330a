"""Finished run folders: each read whole for comparison (`load_run`), and any runs side by side,
whatever they train (`overview`, scripts/compare_runs.py without --invariance): how their configs
differ, how each one ended, and their curves overlaid.

A run folder is read from config.toml (the full config, keys added since filled with their
defaults then), run.json (what "auto" and the layout resolved to), metrics.jsonl,
diagnostics.jsonl, eval.jsonl and fingerprints.json. Anything unreadable is one UserError naming
the file (titanlite.tools.records).

The overview judges nothing: runs that differ in learning rate, data or seed are experiments, and
the user compares them on purpose. The invariance verdict is titanlite.analysis.compare's.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titanlite.analysis.plots import plot_runs
from titanlite.components.fingerprints import FILE
from titanlite.config.job_config import with_plugins
from titanlite.config.layout import mesh_text
from titanlite.config.manager import migrate, to_toml, tomllib
from titanlite.errors import UserError
from titanlite.tools.formatting import fmt
from titanlite.tools.records import read_json, read_records, read_toml


@dataclass
class Run:
    path: Path
    config: dict[str, Any]  # flat "section.key" -> value
    resolved: dict[str, Any]  # run.json ({} if the run predates it)
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
        if not r:
            return "?"
        return (
            f"{mesh_text(r['mode'], r['dp_replicate'], r['dp_shard'], r.get('axes'))}, local batch {r['local_batch_size']}"
            f" x accum {r['grad_accum']}, {r['param_dtype']}"
        )

    @property
    def param_dtype(self) -> str:
        if self.resolved:
            return self.resolved["param_dtype"]
        choice = self.config.get("training.mixed_precision_param", "auto")
        return (
            choice
            if choice != "auto"
            else ("float32" if self.config.get("training.device") == "cpu" else "?")
        )

    def last_step(self) -> int:
        return max(self.metrics)

    def logs_every_step(self) -> bool:
        """Whether metrics.jsonl should hold every step: a row per step, or a log every step."""
        return self.config.get("metrics.log_every") == 1 or any(
            "row" in r for r in self.metrics.values()
        )


def load_run(path: str | Path) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: no such run folder")
    cfg_file, metrics_file = path / "config.toml", path / "metrics.jsonl"
    if not cfg_file.is_file():
        raise UserError(
            f"{path}: no config.toml, so not a titanlite run folder (<dump_folder>/<run_name>)"
        )
    if not metrics_file.is_file():
        raise UserError(f"{path}: no metrics.jsonl; the run stopped before its first log step")
    raw = read_toml(cfg_file, "a run writes it whole as it starts")
    raw, _ = migrate(raw, str(cfg_file))
    # A key added to titanlite after the run was written had its default value then.
    defaults = tomllib.loads(to_toml(with_plugins()))
    merged = {sec: {**defaults.get(sec, {}), **t} for sec, t in raw.items() if isinstance(t, dict)}
    config = {
        f"{sec}.{k}": v for sec, table in {**defaults, **merged}.items() for k, v in table.items()
    }
    resolved = (
        read_json(path / "run.json", "it is written as a run starts")
        if (path / "run.json").is_file()
        else {}
    )
    metrics = {r["step"]: r for r in read_records(metrics_file, cut_off="refuse") if "step" in r}
    if not metrics:
        raise UserError(f"{metrics_file}: empty; the run stopped before its first log step")
    diag_file = path / "diagnostics.jsonl"
    diag = {r["step"]: r for r in read_records(diag_file) if "step" in r}
    eval_file = path / "eval.jsonl"
    evals = {r["step"]: r for r in read_records(eval_file) if "step" in r}
    prints = (
        read_json(path / FILE, "it is written whole by the run")
        if (path / FILE).is_file()
        else None
    )
    return Run(path, config, resolved, metrics, diag, evals, prints)


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
            lines.append(
                f"  {key}: " + ", ".join(f"{n} {v!r}" for n, v in zip(names, values, strict=True))
            )
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
    record = [
        {"run": str(r.path), "label": n, **e} for n, r, e in zip(names, runs, ends, strict=True)
    ]
    (out_dir / "runs.json").write_text(json.dumps({"runs": record, "differences": diff}, indent=1))
    plot_runs(runs, out_dir / "runs.png")
    lines.append(f"table, JSON and plot: {out_dir}/{{runs.txt,runs.json,runs.png}}")
    return "\n".join(lines)
