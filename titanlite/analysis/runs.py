"""A finished run folder, read whole for comparison: config.toml (the full config, keys added
since filled with their defaults then), run.json (what "auto" and the layout resolved to),
metrics.jsonl, diagnostics.jsonl, eval.jsonl and fingerprints.json. Anything unreadable is one
UserError naming the file (titanlite.tools.records)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titanlite.components.fingerprints import FILE
from titanlite.config.job_config import with_plugins
from titanlite.config.layout import mesh_text
from titanlite.config.manager import migrate, to_toml, tomllib
from titanlite.errors import UserError
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
        return self.config.get("metrics.log_every") == 1 or any("row" in r for r in self.metrics.values())


def load_run(path: str | Path) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: no such run folder")
    cfg_file, metrics_file = path / "config.toml", path / "metrics.jsonl"
    if not cfg_file.is_file():
        raise UserError(f"{path}: no config.toml, so not a titanlite run folder (<dump_folder>/<run_name>)")
    if not metrics_file.is_file():
        raise UserError(f"{path}: no metrics.jsonl; the run stopped before its first log step")
    raw = read_toml(cfg_file, "a run writes it whole as it starts")
    raw, _ = migrate(raw, str(cfg_file))
    # A key added to titanlite after the run was written had its default value then.
    defaults = tomllib.loads(to_toml(with_plugins()))
    merged = {sec: {**defaults.get(sec, {}), **t} for sec, t in raw.items() if isinstance(t, dict)}
    config = {f"{sec}.{k}": v for sec, table in {**defaults, **merged}.items() for k, v in table.items()}
    resolved = (
        read_json(path / "run.json", "it is written as a run starts") if (path / "run.json").is_file() else {}
    )
    metrics = {r["step"]: r for r in read_records(metrics_file, cut_off="refuse") if "step" in r}
    if not metrics:
        raise UserError(f"{metrics_file}: empty; the run stopped before its first log step")
    diag_file = path / "diagnostics.jsonl"
    diag = {r["step"]: r for r in read_records(diag_file) if "step" in r}
    eval_file = path / "eval.jsonl"
    evals = {r["step"]: r for r in read_records(eval_file) if "step" in r}
    prints = read_json(path / FILE, "it is written whole by the run") if (path / FILE).is_file() else None
    return Run(path, config, resolved, metrics, diag, evals, prints)
