"""Fault injection ([debug] switches): provoke, on real runs, what the diagnostics must detect.

- same_data: every rank reads rank 0's share (the "rank not passed to the loader" bug);
- corrupt_labels_rank: that rank's labels are shuffled within each sequence (a bad batch);
- grad_noise_rank: Gaussian noise is added to that rank's local gradient before the reduction
  (a stand-in for a device with silent data corruption), applied by the gradient probe;
- seed_mode: the paper's S1-1 "shared" (all ranks share the seed of dropout and of the data
  shuffle), S1-2 "rank0_differs", S1-3 "per_rank". Dropout (model.dropout) makes seeds matter.
"""

from __future__ import annotations

import torch

from titanlite.components.loss import IGNORE_INDEX
from titanlite.config import JobConfig

_SEED_STRIDE = 1_000_003


def rank_seed(cfg: JobConfig, rank: int) -> int:
    """Seed of this rank's dropout RNG and of the permutation it reads its data from."""
    mode, seed = cfg.debug.seed_mode, cfg.training.seed
    if mode == "per_rank" or (mode == "rank0_differs" and rank == 0):
        return seed + _SEED_STRIDE * (rank + 1)
    return seed


def data_rank(cfg: JobConfig, rank: int) -> int:
    """Which rank's share of the global batch this rank reads."""
    return 0 if cfg.debug.same_data else rank


def corrupt_labels(labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Shuffle each sequence's valid labels among its valid positions (host tensors)."""
    out = labels.clone()
    for row in out:
        valid = (row != IGNORE_INDEX).nonzero().flatten()
        row[valid] = row[valid[torch.randperm(len(valid), generator=generator)]]
    return out
