"""Where a run writes and what it resumes, from the config and the disk alone (torch-free), for
the launcher and again for the workers' rank 0. The default run name is the config's stem, or
the data's name when the command line chose data the config does not hold (run_stem), then the
start time (the launcher fixes it); under SLURM `<stem>-slurm<job id>`, alike on every node."""

from __future__ import annotations

import os
import re
import shutil
import sys
from datetime import datetime
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python < 3.11
    import tomli as tomllib

from titanlite.components.checkpoint.index import checkpoint_folder, find
from titanlite.components.checkpoint.resume import check_resumable
from titanlite.config import JobConfig
from titanlite.config.command_line import mixture_items
from titanlite.errors import UserError
from titanlite.tools.paths import existing_parent
from titanlite.tools.records import REHEARSAL_FILE

_STEM_MAX = 64  # characters of a run name's data part, its date and time after it


def data_names(path: str) -> list[str]:
    """data.path's datasets by name: a file's stem, a folder's name."""
    out = []
    for name, _ in mixture_items(path):
        p = Path(name).expanduser()
        out.append(p.name if p.is_dir() else p.stem)
    return out


def _config_data(config_path: str | None) -> str:
    """The data.path the config file itself holds ('' for none, or no file to read)."""
    if not config_path:
        return ""
    try:
        data = tomllib.loads(Path(config_path).read_text()).get("data")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return ""  # the config's own reader has refused it already, or will
    path = data.get("path") if isinstance(data, dict) else None
    return path if isinstance(path, str) else ""


def run_stem(cfg: JobConfig, config_path: str | None) -> str:
    """What a run is named after: its data where the command line chose data the config does
    not hold (one's own data on a shipped config), else its config file."""
    names = data_names(cfg.data.path)
    if names and names != data_names(_config_data(config_path)):
        stem = "+".join(names)
        if len(names) > 1 and len(stem) > _STEM_MAX:  # a long mixture: its first and a count
            stem = f"{names[0]}+{len(names) - 1}-more"
        return re.sub(r"[^A-Za-z0-9._+-]+", "-", stem)[:_STEM_MAX].strip(".-") or "data"
    return Path(config_path).stem if config_path else "default"


def run_name(cfg: JobConfig, config_path: str | None, nnodes: int = 1) -> str:
    if cfg.job.run_name:
        return cfg.job.run_name
    stem = run_stem(cfg, config_path)
    if cfg.rehearsal.world:
        stem += f"-rehearse{cfg.rehearsal.world}"
    if os.environ.get("SLURM_JOB_ID"):
        return f"{stem}-slurm{os.environ['SLURM_JOB_ID']}"
    if nnodes > 1:
        raise UserError(
            "a run on several nodes needs --job.run_name (every node must open the same run folder); under SLURM the job id names it"
        )
    return f"{stem}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def run_folder(cfg: JobConfig, config_path: str | None = None, nnodes: int = 1) -> Path:
    """Where the run writes: `<job.dump_folder>/<run name>`."""
    return Path(cfg.job.dump_folder).expanduser() / run_name(cfg, config_path, nnodes)


def trace_folder(cfg: JobConfig) -> Path:
    """Where NCCL's flight recorder dumps, set before the process group exists: the run folder's
    comm_trace/ when the run is named (the launcher always names it), else the dump folder's."""
    return Path(cfg.job.dump_folder).expanduser() / cfg.job.run_name / "comm_trace"


def is_restart() -> bool:
    """This worker group was restarted by torchrun (--max-restarts) after a failure."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def resume_plan(
    cfg: JobConfig, run_dir: Path, restarted: bool, data: list[dict] | None = None
) -> tuple[int | None, str | None]:
    """The checkpoint step to resume from (None: a fresh run), and how the data changed since it
    if data.accept_change lets it. Refuses a checkpoint this run may not resume, and a folder of
    another run that logged a step but has no checkpoint (unless torchrun restarts this run)."""
    rehearsal = (run_dir / REHEARSAL_FILE).is_file()
    if rehearsal != bool(cfg.rehearsal.world) and (run_dir / "config.toml").is_file():
        held = "a rehearsal, which trained nothing" if rehearsal else "a training run"
        raise UserError(
            f"run folder '{run_dir}' holds {held}; a rehearsal and a training run never share a folder: pick another --job.run_name or move it"
        )
    if cfg.rehearsal.world:
        return None, None  # a rehearsal never resumes: it starts over in its own folder
    folder = checkpoint_folder(cfg, run_dir)
    resume = find(folder, cfg.checkpoint.load_step)
    if resume is not None:
        if resume > cfg.training.steps:
            raise UserError(
                f"training.steps is {cfg.training.steps} but the checkpoint to resume in '{folder}' is at step {resume}; raise --training.steps to {resume} or more, or rewind with --checkpoint.load_step (an earlier step of that folder)"
            )
        return resume, check_resumable(folder, resume, cfg, run_dir, data)
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0 and not restarted:
        raise UserError(
            f"run folder '{run_dir}' already holds a run without a checkpoint to resume; pick another --job.run_name or move it"
        )
    return None, None


def check_checkpoint_space(folder: Path, need_bytes: int, what: str) -> None:
    """Free space for one more checkpoint, estimated by the caller (`what` says of what)."""
    free = shutil.disk_usage(existing_parent(folder)).free
    if free < need_bytes:
        raise UserError(
            f"checkpoint.folder '{folder}' has {free / 2**30:.1f} GiB free but one checkpoint of {what} needs about {need_bytes / 2**30:.1f} GiB; free space, point checkpoint.folder elsewhere, or set checkpoint.every = 0 and checkpoint.at_end = false"
        )
