"""The run folder: where a run writes (config.toml, run.json, metrics, checkpoints) and whether
it resumes.

`<job.dump_folder>/<job.run_name>` (default name: <config stem>-<date>-<time>). A folder that
holds a complete checkpoint (in checkpoint.folder) is resumed from it; one that holds a run
without a checkpoint is refused, so two runs never mix in one metrics file. Everything is
decided and checked before the first file is written.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.components import checkpoint
from titanlite.components.metrics import truncate_after
from titanlite.config import JobConfig
from titanlite.config.manager import to_toml
from titanlite.distributed.parallel_dims import ParallelDims
from titanlite.distributed.utils import first_error
from titanlite.errors import UserError

logger = logging.getLogger("titanlite")


def checkpoint_folder(cfg: JobConfig, run_dir: Path) -> Path:
    """checkpoint.folder; a relative one lives inside the run folder."""
    folder = Path(cfg.checkpoint.folder).expanduser()
    return folder if folder.is_absolute() else run_dir / folder


def run_info(cfg: JobConfig, dims: ParallelDims, diagnostics_method: str) -> dict:
    """run.json: what the config left to the machine ("auto" and derived values), for run
    comparison (titanlite.tools.compare)."""
    lay = dims.layout
    return {
        "world_size": dims.dp_size,
        "mode": lay.mode,
        "dp_replicate": lay.dp_replicate,
        "dp_shard": lay.dp_shard,
        "local_batch_size": cfg.training.local_batch_size,
        "grad_accum": lay.grad_accum,
        "device": dims.device.type,
        "param_dtype": str(dims.param_dtype).removeprefix("torch."),
        "reduce_dtype": str(dims.reduce_dtype).removeprefix("torch."),
        "diagnostics_method": diagnostics_method,
        "torch": torch.__version__,
        "started": datetime.now().isoformat(timespec="seconds"),
    }


def open_run_folder(cfg: JobConfig, config_path: str | None, info: dict) -> tuple[Path, int | None]:
    """Every rank calls it. Rank 0 picks the run folder and the step to resume from (None: a
    fresh run), refuses a checkpoint trained on something else before anything is written, then
    writes config.toml and run.json; every rank learns the folder and the step, or the error."""
    found, error = [None, None], None
    if dist.get_rank() == 0:
        stem = Path(config_path).stem if config_path else "default"
        name = cfg.job.run_name or f"{stem}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
        run_dir = Path(cfg.job.dump_folder).expanduser() / name
        try:
            found = [str(run_dir), _prepare(cfg, run_dir, info)]
        except UserError as e:
            error = str(e)
        except OSError as e:
            error = f"cannot write the run folder '{run_dir}' ({e}); pick a writable --job.dump_folder"
    error = first_error(error)
    if error:
        raise UserError(error)
    dist.broadcast_object_list(found, src=0)
    if dist.get_rank() == 0:
        logger.info(f"run folder: {found[0]}")
    return Path(found[0]), found[1]


def _prepare(cfg: JobConfig, run_dir: Path, info: dict) -> int | None:
    folder = checkpoint_folder(cfg, run_dir)
    resume = checkpoint.find(folder, cfg.checkpoint.load_step)
    if resume is not None:
        checkpoint.check_compatible(folder, resume, cfg)
    elif (run_dir / "metrics.jsonl").exists():
        raise UserError(
            f"run folder '{run_dir}' already holds a run without a checkpoint to resume; "
            "pick another --job.run_name or move it"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    if resume is not None:
        truncate_after(run_dir, resume)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    (run_dir / "run.json").write_text(json.dumps(info, indent=1) + "\n")
    return resume
