"""Cross entropy over a vocabulary split among tensor-parallel ranks, without gathering the logits
(Megatron-LM's vocab-parallel cross entropy, Shoeybi et al., arXiv 1909.08053).

Each rank holds the logits of its slice of the vocabulary. The forward takes three all-reduces
over the tensor-parallel group: the row maximum (for a stable softmax), the sum of exponentials,
and the target's logit (only the rank whose slice holds the target contributes it). The
backward needs none: softmax minus the one-hot target, restricted to the rank's own slice, is
the gradient of the rank's own logits. Every rank ends with the same per-position losses."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from titanlite.ops.cross_entropy import IGNORE_INDEX


def vocab_slice(vocab: int, ranks: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of the vocabulary rank `rank` of `ranks` holds, as DTensor's Shard(0) cuts a
    weight of `vocab` rows (torch.chunk: ceil-sized pieces, the last ones shorter or empty)."""
    size = -(-vocab // ranks)
    return min(rank * size, vocab), min((rank + 1) * size, vocab)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, lo: int, group: dist.ProcessGroup):  # type: ignore[override]
        x = logits.float()
        top = x.max(-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        x = x - top.unsqueeze(-1)
        e = x.exp()
        total = e.sum(-1)
        dist.all_reduce(total, group=group)
        valid = labels != IGNORE_INDEX
        local = labels - lo
        mine = valid & (local >= 0) & (local < x.shape[-1])
        index = torch.where(mine, local, 0).unsqueeze(-1)
        target = torch.where(mine, x.gather(-1, index).squeeze(-1), 0.0)
        dist.all_reduce(target, group=group)
        ctx.save_for_backward(e / total.unsqueeze(-1), index, mine, valid)
        ctx.dtype = logits.dtype
        return torch.where(valid, total.log() - target, 0.0)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        softmax, index, mine, valid = ctx.saved_tensors
        g = torch.where(valid, grad, 0.0).unsqueeze(-1)
        out = softmax * g
        out.scatter_add_(-1, index, -(g * mine.unsqueeze(-1)))
        return out.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, lo: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """Each sequence's summed cross entropy [B] (fp32) from this rank's logits [B, S, V/tp] of
    the vocabulary slice starting at `lo`; the same on every rank of `group`."""
    return _VocabParallelCE.apply(logits, labels, lo, group).sum(-1)


def chunked_vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int,
    lo: int,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """vocab_parallel_cross_entropy(hidden @ weight.T, ...) with `weight` this rank's rows of the
    head, `chunk` positions at a time under activation checkpointing (as
    titanlite.ops.cross_entropy.chunked_cross_entropy_per_sample; the backward recomputes a
    chunk's three all-reduces). `chunk` <= 0: the whole sequence at once."""

    def projected(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(F.linear(h, weight), y, lo, group)

    if chunk <= 0:
        return projected(hidden, labels)
    sums = [
        checkpoint(projected, h, y, use_reentrant=False)
        for h, y in zip(hidden.split(chunk, dim=1), labels.split(chunk, dim=1), strict=True)
    ]
    return torch.stack(sums).sum(0)
