"""Every seed a run derives from training.seed, and the rule for torch's own RNG.

The rule. Every data-parallel rank seeds torch's RNG (dropout; every device's generator) with
training.seed, and the data order with the same seed, so all ranks draw one stream and the
sampler cuts one permutation. The stream is then a property of the run, not of a rank: the
ranks' saved RNG states are equal (they make the same draws, on tensors of the same shape), so a
resume at any world size gives every rank rank 0's saved state and continues the same stream,
where per-rank streams would have no counterpart at another world size (rank 5 of 8 at dp=4).
The price: within a step, rank r's microbatch m gets the same dropout mask as rank s's, and a
sequence's mask depends on where the layout puts it, so a dropout run at dp=8 is not the run at
dp=16. model.dropout_masks = "sample" removes both: each sequence's masks are keyed by its place
in the data stream (titanlite.ops.dropout), so dropout runs are dp-invariant, at the cost of an
integer hash per element instead of the fused kernel's RNG (scripts/bench.py --only dropout
measures it; scripts/README.md has the figures). The key is derived from the rank's seed below,
so the seed faults perturb keyed masks too.

faults.seed_mode injects the seed faults of "Silent Inconsistency in Data-Parallel Full
Fine-Tuning" (arXiv 2602.14462): "shared" (S1-1) is the rule above; "rank0_differs" (S1-2) and
"per_rank" (S1-3) give the named ranks a seed of their own, for dropout and data order alike,
which the diagnostics must detect. A resume at another world size reseeds them per rank.
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
