"""The run folder opened by the workers, as components/run/plan.py decides it, under the run lock:
everything is decided and checked before the first file is written."""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.components.checkpoint.index import quarantine_damaged
from titanlite.components.run.files import RunFiles, truncate_after
from titanlite.components.run.lock import HELD_ENV, RunLock
from titanlite.components.run.plan import (
    REHEARSAL_FILE,
    checkpoint_folder,
    is_restart,
    resume_plan,
    run_folder,
)
from titanlite.config import JobConfig
from titanlite.config.manager import to_toml
from titanlite.diagnostics.alerts import Alert
from titanlite.distributed.parallel_dims import ParallelDims
from titanlite.errors import UserError

logger = logging.getLogger("titanlite")


def run_info(cfg: JobConfig, dims: ParallelDims, diagnostics_method: str) -> dict:
    """run.json: what the config left to the machine, for titanlite.analysis.compare."""
    lay = dims.layout
    return {
        "world_size": lay.world,
        "mode": lay.mode,
        "dp_replicate": lay.dp_replicate,
        "dp_shard": lay.dp_shard,
        "axes": dict(lay.axes),
        "local_batch_size": cfg.training.local_batch_size,
        "grad_accum": lay.grad_accum,
        "device": dims.device.type,
        "param_dtype": str(dims.param_dtype).removeprefix("torch."),
        "reduce_dtype": str(dims.reduce_dtype).removeprefix("torch."),
        "diagnostics_method": diagnostics_method,
        "torch": torch.__version__,
        "started": datetime.now().isoformat(timespec="seconds"),
    }


LAYOUT_KEYS = (
    "world_size",
    "mode",
    "dp_replicate",
    "dp_shard",
    "axes",
    "local_batch_size",
    "grad_accum",
)


def layout_at(info: dict, step: int) -> dict:
    """The layout step `step` ran at, from run.json, whose "earlier" keeps the layouts of earlier
    sessions (each with its first step) for scripts/inspect_step.py."""
    for earlier in reversed(info.get("earlier", [])):
        if earlier.get("from_step", 1) <= step < info.get("from_step", 1):
            return earlier
    return info


def _with_earlier(run_dir: Path, info: dict, resume: int | None) -> dict:
    """run.json of a resume: the previous one's layout joins "earlier" (a rewound one's dropped)."""
    if not resume:
        return info
    try:
        before = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    except FileNotFoundError:  # a checkpoint copied into a new folder: its steps ran elsewhere
        return info
    except (OSError, ValueError):
        before = None
    if not isinstance(before, dict):  # said: the history is advisory, the resume goes on
        logger.warning(
            f"{run_dir / 'run.json'} is unreadable: the layouts of the steps before {resume + 1} are not kept (scripts/inspect_step.py splits those steps at this run's layout)"
        )
        return info
    first, earlier = before.get("from_step", 1), before.get("earlier", [])
    kept = [e for e in earlier if isinstance(e, dict) and e.get("from_step", 1) <= resume]
    if first <= resume:
        kept.append({"from_step": first, **{k: before[k] for k in LAYOUT_KEYS if k in before}})
    return {**info, "from_step": resume + 1, "earlier": kept}


def open_run_folder(
    cfg: JobConfig, config_path: str | None, info: dict, data: list[dict] | None = None
) -> tuple[Path, int | None, RunLock | None]:
    """Every rank calls it: rank 0 decides the run folder and the step to resume from (None: a
    fresh run; `data`: titanlite.datasets.spec.data_identity), takes the run lock unless the
    launcher holds it, writes config.toml and run.json; every rank gets them, or the error."""
    found, lock = [None, None, None], None  # the run folder, the resume step, or the error
    if dist.get_rank() == 0:
        run_dir = run_folder(cfg, config_path)
        lock = RunLock(run_dir)
        if os.environ.get(HELD_ENV) == str(lock.path.resolve()):
            lock = None  # the launcher holds it
        try:
            # before its checkpoints are read: a live run may be pruning them
            if lock and run_dir.is_dir():
                lock.acquire()
            resume, changed = resume_plan(cfg, run_dir, is_restart(), data)
            info = {**info, "data": data, **({"data_change_accepted": changed} if changed else {})}
            run_dir.mkdir(parents=True, exist_ok=True)
            if lock:  # the folder is new
                lock.acquire()
            quarantine_damaged(checkpoint_folder(cfg, run_dir), cfg.metrics.enable_wandb)
            found[:2] = [str(run_dir), resume]
            _write(cfg, run_dir, info, resume)
            if changed:
                _data_changed(run_dir, resume, changed)
            logger.info(f"run folder: {run_dir}")
        except UserError as e:
            found[2] = str(e)
        except OSError as e:
            found[2] = (
                f"cannot write the run folder '{run_dir}' ({e}); pick a writable --job.dump_folder"
            )
        if found[2] and lock is not None:
            lock.release()
    dist.broadcast_object_list(found, src=0)
    if found[2]:
        raise UserError(found[2])
    return Path(found[0]), found[1], lock


def _data_changed(run_dir: Path, step: int, change: str) -> None:
    """The note of a resume on changed data: the console and events.jsonl (as an alert's record)."""
    message = f"resumed on changed data (data.accept_change): {change}"
    note = Alert("data_changed", step, [], [], message, level="info")
    logger.warning(note.line())
    files = RunFiles(run_dir)
    files.append("events.jsonl", [note.to_dict()])
    files.close()


def _write(cfg: JobConfig, run_dir: Path, info: dict, resume: int | None) -> None:
    if resume is not None or is_restart():  # a restarted attempt without a checkpoint starts over
        truncate_after(run_dir, resume or 0)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    info = _with_earlier(run_dir, info, resume)
    (run_dir / "run.json").write_text(json.dumps(info, indent=1) + "\n")
    if cfg.rehearsal.world:  # the mark that no training run may resume here (REHEARSAL_FILE)
        mark = {"world": cfg.rehearsal.world, "complete": False}
        (run_dir / REHEARSAL_FILE).write_text(json.dumps(mark) + "\n")
