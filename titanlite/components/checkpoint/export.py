"""What a run leaves for use outside titanlite when it ends: checkpoint.export_weights (the full
weights as one torch.save file) and checkpoint.export_hf (a Hugging Face folder, hf_export.py)."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from titanlite.components.checkpoint.hf_export import export_hf
from titanlite.config import JobConfig
from titanlite.distributed.liveness import in_phase
from titanlite.tools.cache import atomic_write_bytes

logger = logging.getLogger("titanlite")


def export_weights(model: torch.nn.Module, path: Path) -> None:
    """The full, unsharded model weights as one torch.save file at `path` (for evaluation or
    conversion); every rank takes part in the gather, rank 0 writes atomically."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        buf = io.BytesIO()
        torch.save(state, buf)
        atomic_write_bytes(path, buf.getvalue())
        logger.info(f"exported full weights to {path}")


@in_phase("export")
def export_run(cfg: JobConfig, model: torch.nn.Module, meta, tokenizer, run_dir: Path) -> list[Path]:
    """The exports the config asks for, into the run folder (every rank calls it); `meta`: the
    MetaModel (titanlite.models.registry), `tokenizer`: the run's (its files go with an HF
    folder when it is a Hugging Face one). Returns what it wrote."""
    c = cfg.checkpoint
    written = []
    if c.export_weights:
        export_weights(model, run_dir / "weights.pt")
        written.append(run_dir / "weights.pt")
    if c.export_hf:
        source = cfg.model.hf_assets_path
        export_hf(
            model,
            run_dir / "hf",
            meta.spec.hf,
            meta.args,
            c.export_dtype,
            Path(source).expanduser() if source else None,
            tokenizer,
        )
        written.append(run_dir / "hf")
    return written
