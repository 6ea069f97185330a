"""What a rehearsal (`rehearsal.world` > 0, ./run_train.sh --rehearse W) changes in the run it
rehearses, decided once from the config alone, so the preflight, the trainer and the report all
read the same plan.

A rehearsal builds the run as configured, as rank 0 of `world` ranks in one process on torch's fake
process group (titanlite.rehearsal): collectives return at once, shapes are true, values are
meaningless. So it keeps all that costs memory, compute or traffic (the model, its sharding and
mixed precision, activation checkpointing, compile, the loss path, the optimizer, the
diagnostics) and drops what would read or keep the meaningless values: checkpoints, evals,
exports, an initial load, the metrics files, the spike guard's skips. The global batch is the
config's where it splits over `world` ranks, else `world` x the local batch.
"""

from __future__ import annotations

from typing import Any

from titanlite.config.job_config import JobConfig

# Of the rehearsed steps, the first builds AdamW's state (and compiles); from the second, every
# other step is measured by the diagnostics, so the report has both kinds side by side.
MEASURED_EVERY = 2


def rehearsal_batch(global_batch: int, local_batch: int, world: int) -> int:
    """The global batch at `world` ranks: the config's if world x local divides it (the
    accumulation it gives then), else world x local (one microbatch per step)."""
    return global_batch if global_batch % (world * local_batch) == 0 else world * local_batch


def rehearsal_changes(cfg: JobConfig) -> dict[str, Any]:
    """The `section.key -> value` a rehearsal sets ({} when none is asked for)."""
    world = cfg.rehearsal.world
    if world <= 0:  # 0: a training run; below: the bounds check refuses it
        return {}
    t = cfg.training
    changes = {
        "training.global_batch_size": rehearsal_batch(t.global_batch_size, t.local_batch_size, world),
        "training.steps": cfg.rehearsal.steps,
        "checkpoint.every": 0,
        "checkpoint.at_end": False,
        "checkpoint.export_weights": False,
        "checkpoint.export_hf": False,
        "checkpoint.initial_load_path": "",
        "eval.every": 0,
        "eval.at_end": False,
        "metrics.enable_tensorboard": False,
        "metrics.enable_wandb": False,
        "spike_guard.skip": "off",
        "diagnostics.measure_first": 0,
        "diagnostics.every": MEASURED_EVERY,
        "diagnostics.on_alert": "warn",
    }
    return {k: v for k, v in changes.items() if _get(cfg, k) != v}


def apply_rehearsal(cfg: JobConfig) -> str | None:
    """Set what a rehearsal changes; the one line that says so (None when it changes nothing: a
    training run, or a rehearsal's config.toml read back)."""
    changes = rehearsal_changes(cfg)
    if not changes:
        return None
    t, world = cfg.training, cfg.rehearsal.world
    batch = changes.get("training.global_batch_size", t.global_batch_size)
    accum = batch // (world * t.local_batch_size)
    why = (
        ""
        if batch == t.global_batch_size
        else f"; the config's {t.global_batch_size} does not split over {world}"
    )
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return (
        f"rehearsal: rank 0 of {world} on a fake process group, {cfg.rehearsal.steps} steps; global batch "
        f"{batch} ({world} ranks x local {t.local_batch_size} x accumulation {accum}{why}); no checkpoint, "
        "eval, export, initial load or metrics file; alerts muted; every update applied"
    )


def _get(cfg: JobConfig, dotted: str) -> Any:
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)
