"""Which sequences a training step read, from the config alone: the batch of a step depends only
on the seed, the global batch size, seq_len and the data (see sampler.py), so neither the run
nor a GPU is needed. Used by scripts/trace_batch.py and scripts/inspect_step.py."""

from __future__ import annotations

from titanlite.config import JobConfig
from titanlite.config.layout import rank_share
from titanlite.datasets.build import build_dataset, build_tokenizer
from titanlite.datasets.sampler import GlobalBatchSampler
from titanlite.errors import UserError


def trace_step(cfg: JobConfig, step: int, dp: int = 1, rank: int | None = None, dataset=None) -> list[dict]:
    """One entry per sequence of step `step` (1-based): its position in the global batch, the
    rank that reads it at `dp`, its index and its sources (file, row, token range)."""
    g = cfg.training.global_batch_size
    if step < 1 or g % dp or (rank is not None and not 0 <= rank < dp):
        raise UserError(f"--step must be >= 1, --dp divide global_batch_size {g}, and --rank be in [0, dp)")
    dataset = dataset or build_dataset(cfg, build_tokenizer(cfg))
    sampler = GlobalBatchSampler(dataset.sizes, g, g, 0, 1, cfg.training.seed, dataset.weights)
    per_rank = rank_share(cfg, dp)
    out = []
    for j, index in enumerate(sampler.global_batch(step - 1).tolist()):
        if rank is None or j // per_rank == rank:
            out.append(
                {"position": j, "rank": j // per_rank, "sequence": index, "sources": dataset.trace(index)}
            )
    return out
