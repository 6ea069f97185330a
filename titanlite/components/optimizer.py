"""AdamW (fused) with weight-decay groups, and the warmup + decay LR schedule. The fused kernel
skips the whole update (params, moments, step count) on the device where its `found_inf` flag is 1,
which titanlite sets for a step with no valid token or a non-finite gradient norm: skipping needs
no host sync."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.optim.lr_scheduler import LambdaLR

from titanlite.config import JobConfig


def param_groups(model: nn.Module, cfg: JobConfig) -> list[dict]:
    """AdamW's groups: weight decay on matrices only, and on embedding tables only with
    optimizer.weight_decay_embeddings (decay would pull a gain, or a rare token's row, toward 0
    for no regularising gain); "decay" marks each, so a resume can reset them group by group."""
    embeddings = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    decay, exempt = [], []
    for p in model.parameters():  # each tied parameter once
        spared = p.ndim < 2 or (id(p) in embeddings and not cfg.optimizer.weight_decay_embeddings)
        (exempt if spared else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.optimizer.weight_decay, "decay": True},
        {"params": exempt, "weight_decay": 0.0, "decay": False},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: JobConfig) -> torch.optim.AdamW:
    o = cfg.optimizer
    return torch.optim.AdamW(
        param_groups(model, cfg), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True
    )


def set_skip(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """Make the next optimizer.step() a no-op where `skip` (a device bool scalar) is true."""
    optimizer.found_inf = skip.to(torch.float32)


def lr_factor(step: int, cfg: JobConfig) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    s, total = cfg.lr_scheduler, cfg.training.steps
    warmup = min(s.warmup_steps, total)
    if step < warmup:
        return (step + 1) / warmup
    if s.decay_type == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    decay = 1.0 - progress if s.decay_type == "linear" else cosine
    return s.min_lr_factor + (1.0 - s.min_lr_factor) * decay


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: JobConfig) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg))


def continue_schedule(
    optimizer: torch.optim.Optimizer, scheduler: LambdaLR, cfg: JobConfig, position: int
) -> None:
    """After loading another run's optimizer state: this run's hyperparameters (the loaded param
    groups carry the source's), and the schedule at `position` (the source's optimizer steps),
    so the first step's lr is lr * lr_factor(position) under this run's schedule settings."""
    o = cfg.optimizer
    for group in optimizer.param_groups:
        decay = o.weight_decay if group.get("decay", True) else 0.0
        group.update(initial_lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=decay)
    n = len(optimizer.param_groups)
    # Through its state dict: LambdaLR.step() here would warn that it ran before optimizer.step().
    scheduler.load_state_dict(
        {**scheduler.state_dict(), "base_lrs": [o.lr] * n, "last_epoch": position}
    )
    realign_schedule(optimizer, scheduler, cfg, position)


def realign_schedule(
    optimizer: torch.optim.Optimizer, scheduler: LambdaLR, cfg: JobConfig, position: int
) -> tuple[float, float]:
    """On a resume with the checkpoint's hyperparameters: the next step's lr under this run's
    schedule (training.steps or [lr_scheduler] may have changed), from the restored peak lr.
    Returns the first group's (old, new): equal, bit for bit, if the schedule did not change."""
    old = optimizer.param_groups[0]["lr"]
    lrs = [group["initial_lr"] * lr_factor(position, cfg) for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler.load_state_dict({**scheduler.state_dict(), "_last_lr": lrs})
    return old, lrs[0]
