"""What each rank contributes to a measured step, packed into one float64 row for one all-gather
and unpacked by name on the host (component.py). Float64 keeps the integers in it exact: dataset
indices and the sampler's order hash are below 2**53.

A row is the fields of SCALARS, then, per sequence of the rank's step (microbatch order), the
fields of PER_SEQUENCE, field by field: [loss_sum x n, tokens x n, index x n, content x n].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The format of a diagnostics.jsonl record (component.Diagnostics.collect builds it from the rows);
# replay.upgrade reads every earlier one. 2: each rank's median cosine to the others and its
# gradient noise (rank_cos_median, rank_noise), every pair's cosine only up to stats.PAIRS_KEPT ranks.
RECORD_VERSION = 2
SCALARS = ("loss_sum", "tokens", "norm_sq", "order", "load_s", "wait_s", "step_s")
PER_SEQUENCE = ("loss_sum", "tokens", "index", "content")


_WEIGHTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def content_fingerprint(tokens: torch.Tensor) -> torch.Tensor:
    """[batch, seq] token ids -> [batch] float64: a fixed random weighting of each row, equal for
    equal rows (the same reduction on the same device), different otherwise with probability ~1."""
    key = (tokens.shape[-1], tokens.device)
    if key not in _WEIGHTS:
        g = torch.Generator().manual_seed(0x5EED)
        _WEIGHTS[key] = (1 + torch.rand(tokens.shape[-1], generator=g, dtype=torch.float64)).to(tokens.device)
    return (tokens.double() * _WEIGHTS[key]).sum(-1)


@dataclass(kw_only=True)
class RankStep:
    """One rank's measured step, on the device until packed."""

    loss_sum: torch.Tensor  # [] its summed token loss
    tokens: torch.Tensor  # [] its valid (target) tokens
    norm_sq: torch.Tensor  # [] squared norm of what it contributes to the gradient reduction
    order: torch.Tensor  # [1] its sampler's hash of the global batch (GlobalBatchSampler.order_hash)
    times: torch.Tensor  # [3] data loading, wait at the start barrier, step time (s; NaN: unknown)
    sequence_loss_sums: torch.Tensor  # [n] per sequence
    sequence_tokens: torch.Tensor  # [n]
    sequence_index: torch.Tensor  # [n] dataset indices
    sequence_content: torch.Tensor  # [n] content fingerprints (content_fingerprint)

    def pack(self) -> torch.Tensor:
        """The row (module doc), float64, on the tensors' device; reads nothing on the host."""
        parts = [self.loss_sum, self.tokens, self.norm_sq, self.order, self.times]
        parts += [self.sequence_loss_sums, self.sequence_tokens, self.sequence_index, self.sequence_content]
        return torch.cat([p.double().reshape(-1) for p in parts])


@dataclass(kw_only=True)
class RankRow:
    """A packed row read on the host, by name."""

    loss_sum: float
    tokens: float
    norm_sq: float
    order: int
    load_s: float | None
    wait_s: float | None
    step_s: float | None
    sequences: list[dict]  # index, tokens, token-mean loss (None without tokens), content

    @classmethod
    def unpack(cls, row: list[float]) -> RankRow:
        head = dict(zip(SCALARS, row[: len(SCALARS)], strict=True))
        for key in ("load_s", "wait_s", "step_s"):
            head[key] = None if math.isnan(head[key]) else head[key]
        head["order"] = int(head["order"])
        rest = row[len(SCALARS) :]
        n = len(rest) // len(PER_SEQUENCE)
        sums, tokens, ids, content = (rest[i * n : (i + 1) * n] for i in range(len(PER_SEQUENCE)))
        sequences = [
            {"index": int(i), "tokens": int(t), "loss": s / t if t > 0 else None, "content": c}
            for s, t, i, c in zip(sums, tokens, ids, content, strict=True)
        ]
        return cls(**head, sequences=sequences)


def fold_replicas(
    rows: list[list[float]], gram: list[list[float]], split: int, exact_norms: bool
) -> tuple[list[list[float]], list[list[float]]]:
    """Rows and Gram of ranks that split each sequence in `split` pieces (parallelism.axes:
    runs of `split` consecutive ranks share a replica's sequences) as one row per replica, which
    is what the diagnostics compare. Sums add (losses, tokens, per sequence too, and the content
    fingerprints, which are linear in the tokens); the batch's order and the sequences' indices
    are the replica's; it loads as slowly as its slowest piece and waits as briefly as its
    latest. A replica's gradient is the sum of its pieces', so its inner products are the Gram's
    block sums and its squared norm the block's whole (`exact_norms`: the diagonal from each
    rank's own exact norm, the cross terms from the Gram)."""
    if split == 1:
        return rows, gram
    blocks = [range(a, a + split) for a in range(0, len(rows), split)]
    n = (len(rows[0]) - len(SCALARS)) // len(PER_SEQUENCE)
    folded = []
    for block in blocks:
        part = [rows[i] for i in block]
        col = dict(zip(SCALARS, zip(*(r[: len(SCALARS)] for r in part), strict=True), strict=True))
        cross = sum(gram[i][j] for i in block for j in block if i != j)
        own = sum(col["norm_sq"]) if exact_norms else sum(gram[i][i] for i in block)
        head = {
            "loss_sum": sum(col["loss_sum"]),
            "tokens": sum(col["tokens"]),
            "norm_sq": own + cross,
            "order": col["order"][0],
            "load_s": max(col["load_s"], key=lambda t: -math.inf if math.isnan(t) else t),
            "wait_s": min(col["wait_s"], key=lambda t: math.inf if math.isnan(t) else t),
            "step_s": max(col["step_s"], key=lambda t: -math.inf if math.isnan(t) else t),
        }
        row = [head[name] for name in SCALARS]
        rest = [r[len(SCALARS) :] for r in part]
        for f, field in enumerate(PER_SEQUENCE):
            span = slice(f * n, (f + 1) * n)
            if field == "index":
                row += rest[0][span]
            else:
                row += [sum(vals) for vals in zip(*(r[span] for r in rest), strict=True)]
        folded.append(row)
    replica_gram = [[sum(gram[i][j] for i in a for j in b) for b in blocks] for a in blocks]
    return folded, replica_gram
