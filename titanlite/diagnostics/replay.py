"""Replay: the alerts today's rules raise on a run's recorded measured steps (diagnostics.jsonl),
with any [alerts] thresholds: how thresholds are tuned and rule changes held to their alerts
(tests/recordings/). replica_drift and spike_skipped are not replayed: what they read is not in
the records (events.jsonl keeps what they raised)."""

from __future__ import annotations

import json
import lzma
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from titanlite.config.job_config import Alerts as AlertsConfig
from titanlite.config.job_config import JobConfig
from titanlite.diagnostics.alerts import Alert, AlertMonitor
from titanlite.diagnostics.step_record import RECORD_VERSION
from titanlite.errors import UserError
from titanlite.tools.records import read_records

NOT_REPLAYED = ("replica_drift", "spike_skipped")
# What an alert is compared by: a replay raises the same alerts at the same steps, word for word.
SAME = ("step", "name", "ranks", "message", "level")


def last_per_step(records: Iterable[dict]) -> list[dict]:
    """The last record of each step, in step order (a resumed run writes some steps again)."""
    return [r for _, r in sorted({r["step"]: r for r in records}.items())]


def replay(records: list[dict], cfg: AlertsConfig, batch_unit: int = 0) -> list[Alert]:
    """The alerts a fresh runner raises on `records` (one run's measured steps, in order)."""
    records = last_per_step(records)
    if not records:
        return []
    for rec in records:  # version 1's summaries registry.point derives as it reads them
        version = rec.get("version", 1)
        if not isinstance(version, int) or version > RECORD_VERSION:
            raise UserError(
                f"a diagnostics record has format version {version!r}, newer than this titanlite's {RECORD_VERSION}: "
                "replay it with the titanlite that wrote it, or update titanlite"
            )
    world = len(records[0]["rank_loss"])
    monitor = AlertMonitor(cfg, ["-"] * world, batch_unit)
    return [a for rec in records for a in monitor.update(rec)]


def _run(run_dir: Path, overrides: Iterable[str] = ()) -> tuple[JobConfig, list[dict], int]:
    """A run folder's config (with `overrides`), its measured steps (the last record of each) and
    its batch unit: the data-parallel ranks the records compare x the local batch."""
    from titanlite.config import parse_args

    cfg, _ = parse_args(["--config", str(run_dir / "config.toml"), *overrides])
    records = last_per_step(read_records(run_dir / "diagnostics.jsonl"))
    world = len(records[0]["rank_loss"]) if records else 1
    return cfg, records, world * cfg.training.local_batch_size


def replay_run(run_dir: Path, overrides: list[str] = ()) -> list[dict]:
    """A run folder's measured steps replayed with its config and `overrides` (`--alerts.key
    value`), plus the replica_drift and spike_skipped alerts its events.jsonl recorded, by step."""
    cfg, records, batch_unit = _run(run_dir, overrides)
    alerts = [a.to_dict() for a in replay(records, cfg.alerts, batch_unit)]
    kept = [e for e in read_records(run_dir / "events.jsonl") if e["name"] in NOT_REPLAYED]
    return sorted(alerts + kept, key=lambda a: a["step"])


def recorded(run_dir: Path) -> dict:
    """One run, kept replayable: its [alerts] thresholds, fault switches, batch unit, measured
    steps, the alerts it raised from them (what a later replay must raise again) and those it
    raised from what the records do not hold."""
    cfg, records, batch_unit = _run(run_dir)
    steps = {r["step"] for r in records}
    events = read_records(run_dir / "events.jsonl")
    events = [{k: e[k] for k in SAME} for e in events if e["step"] in steps]
    return {
        "alerts": asdict(cfg.alerts),
        "faults": asdict(cfg.faults) if cfg.faults else {},  # what the alerts should name
        "batch_unit": batch_unit,
        "records": records,
        "raised": [e for e in events if e["name"] not in (*NOT_REPLAYED, "data_changed")],
        "kept": [e for e in events if e["name"] in NOT_REPLAYED],  # raised, not from the records
    }


def save_recording(path: Path, runs: dict[str, Path]) -> None:
    """Runs by name in one xz-compressed JSON file (tests/recordings/)."""
    data = {"format": 1, "runs": {name: recorded(run_dir) for name, run_dir in runs.items()}}
    text = json.dumps(data, separators=(",", ":")).encode()
    path.write_bytes(lzma.compress(text, preset=9 | lzma.PRESET_EXTREME))


def load_recording(path: Path) -> dict[str, dict]:
    return json.loads(lzma.decompress(path.read_bytes()))["runs"]


def compared(alerts: Iterable[dict]) -> list[tuple]:
    """Alerts as what a replay must keep, in a fixed order (an alert's order within a step is not kept)."""
    return sorted(tuple(json.dumps(a[k]) for k in SAME) for a in alerts)
