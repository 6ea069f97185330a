"""Every seed a run derives from training.seed, and the rule for torch's own RNG.

The rule: every data-parallel rank seeds torch's RNG (dropout) and the data order with
training.seed, so all ranks draw one stream and the sampler cuts one permutation. The stream is a
property of the run, not of a rank, so a resume at any world size continues it from rank 0's
saved state, where per-rank streams would have no counterpart (rank 5 of 8 at dp=4). The price,
rank r's microbatch m getting rank s's dropout mask and masks depending on the layout, is removed
by model.dropout_masks = "sample" (titanlite.ops.dropout), whose keys derive from the seed below.

faults.seed_mode injects the seed faults of arXiv 2602.14462 ("Silent Inconsistency in
Data-Parallel Full Fine-Tuning"): "shared" (S1-1) is the rule; "rank0_differs" (S1-2) and
"per_rank" (S1-3) give ranks seeds of their own, which the diagnostics must detect.
"""

from __future__ import annotations

_STRIDE = 1_000_003  # a prime: the streams below never share a seed for small step and rank


def rank_seed(seed: int, rank: int, seed_mode: str = "shared") -> int:
    """The seed of `rank`'s torch RNG and data order: training.seed unless seed_mode injects a
    fault."""
    differs = seed_mode == "per_rank" or (seed_mode == "rank0_differs" and rank == 0)
    return seed + _STRIDE * (rank + 1) if differs else seed


def fault_seed(seed: int, rank: int) -> int:
    """The seed of a fault's own stream on `rank` (the label shuffles of corrupt_labels)."""
    return seed + rank


def sample_seed(seed: int, step: int) -> int:
    """The seed of the eval's text samples at `step`: the same on every rank, and a sample does
    not depend on when earlier ones were drawn."""
    return seed * _STRIDE + step


def reshard_seed(seed: int, step: int, rank: int, stream: int) -> int:
    """A per-rank stream (`stream` 0: torch under a seed fault; 1, 2, ..: the faults' own
    generators) restarted at `step` by a resume at another world size, where the saved per-rank
    states cannot map onto the new ranks."""
    return seed * _STRIDE + step * 1009 + rank + 7919 * stream
