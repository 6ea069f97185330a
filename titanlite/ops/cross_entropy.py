"""Token cross entropy, summed per sequence: the loss path's pure maths (no config, no process
group), shared by the trainer (titanlite.components.loss), the models' chunked loss and the memory
estimate. Why sums and not means: see titanlite.components.loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from titanlite.config.layout import loss_chunk

IGNORE_INDEX = -100
"""Label value that marks a position without a target (prompt, padding)."""


def cross_entropy_per_sample(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each sequence's summed token cross entropy over its valid positions ([batch], fp32 whatever
    the logits' dtype): what the loss path sums, kept per sample for the diagnostics' alerts."""
    per_token = F.cross_entropy(
        logits.flatten(0, -2).float(),
        labels.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return per_token.view(labels.shape).sum(-1)


def chunked_cross_entropy_per_sample(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int
) -> torch.Tensor:
    """cross_entropy_per_sample(hidden @ weight.T, labels) with the logits of `chunk` positions
    alive at a time: each chunk runs under activation checkpointing, so backward recomputes its
    logits (one extra matmul) instead of keeping [batch, seq, vocab] of them (at vocab 128,256 a
    2,048-token sequence's fp32 logits take 1 GB). `chunk` <= 0: the whole sequence at once."""
    if chunk <= 0:
        return _projected_ce(hidden, weight, labels)
    # split, not slices: backward gathers the chunks' gradients once, where each slice's would
    # be a zero-padded full-size tensor
    sums = [
        checkpoint(_projected_ce, h, weight, y, use_reentrant=False)
        for h, y in zip(hidden.split(chunk, dim=1), labels.split(chunk, dim=1), strict=True)
    ]
    return torch.stack(sums).sum(0)


def _projected_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return cross_entropy_per_sample(F.linear(hidden, weight), labels)


def chunk_positions(budget_mib: float, local_batch: int, seq_len: int, vocab: int) -> int:
    """Sequence positions per chunk for a fork's own chunked loss: seq_len when one sequence's
    fp32 logits fit in `budget_mib` (the plan's loss_chunk, titanlite.config.layout, says 0)."""
    return loss_chunk(budget_mib, local_batch, seq_len, vocab) or seq_len


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross entropy over valid positions (the per-sample sums, added)."""
    return cross_entropy_per_sample(logits, labels).sum()


def count_valid(labels: torch.Tensor) -> torch.Tensor:
    """Number of positions that carry a target, as a device int64 scalar."""
    return (labels != IGNORE_INDEX).sum()
