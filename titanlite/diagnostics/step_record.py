"""What each rank contributes to a measured step: one float64 row (exact for the dataset indices
and the order hash, below 2**53) for one all-gather, read back by name on the host: `unpack`,
then `fold_replicas`, then `RankRow.of`. A row is SCALARS, then the model's loss terms (as many
as it adds, in their order), then PER_SEQUENCE field by field."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch

# The format of a diagnostics.jsonl record (component.Diagnostics.collect builds it); version 1's
# missing summaries registry.point derives. 2: each rank's median cosine to the others and its
# gradient noise (rank_cos_median, rank_noise); cos_matrix only up to stats.PAIRS_KEPT ranks.
RECORD_VERSION = 2
# What every rank of the job must hold alike at a step (RankStep.shared), as records name them.
SHARED = ("tokens", "grad_norm", "skip")
SCALARS = (
    *("loss_sum", "tokens", "norm_sq", "order", "load_s", "wait_s", "step_s"),
    *(f"shared_{name}" for name in SHARED),
)
PER_SEQUENCE = ("sequence_loss_sums", "sequence_tokens", "sequence_index", "sequence_content")


@functools.cache
def _weights(n: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0x5EED)
    return (1 + torch.rand(n, generator=g, dtype=torch.float64)).to(device)


def content_fingerprint(tokens: torch.Tensor) -> torch.Tensor:
    """[batch, seq] token ids -> [batch] float64: a fixed random weighting of each row, equal for
    equal rows (the same reduction on the same device), different otherwise with probability ~1."""
    return (tokens.double() * _weights(tokens.shape[-1], tokens.device)).sum(-1)


@dataclass(kw_only=True)
class RankStep:
    """One rank's measured step, on the device until packed."""

    loss_sum: torch.Tensor  # [] its summed token loss
    tokens: torch.Tensor  # [] its valid (target) tokens
    norm_sq: torch.Tensor  # [] squared norm of what it contributes to the gradient reduction
    order: torch.Tensor  # [1] its sampler's hash of the global batch
    times: torch.Tensor  # [3] data loading, wait at the start barrier, step time (s; NaN: unknown)
    # [3] what it holds of the step's values that every rank must share (SHARED: the global token
    # count, the gradient norm before clipping, the skip flag; NaN: not known), compared across all
    # ranks as the step is read (rules.shared_mismatch)
    shared: torch.Tensor | None = None
    # [k] its shares of the k loss terms the model adds (each divided by the step's N; None: none)
    terms: torch.Tensor | None = None
    sequence_loss_sums: torch.Tensor  # [n] per sequence
    sequence_tokens: torch.Tensor  # [n]
    sequence_index: torch.Tensor  # [n] dataset indices
    sequence_content: torch.Tensor  # [n] content fingerprints (content_fingerprint)

    def pack(self) -> torch.Tensor:
        """The row (module doc), float64, on the tensors' device; reads nothing on the host."""
        parts = [getattr(self, f.name) for f in fields(self)]
        if self.shared is None:
            parts[[f.name for f in fields(self)].index("shared")] = torch.full_like(
                self.times, math.nan, dtype=torch.float64
            )
        return torch.cat([t.double().reshape(-1) for t in parts if t is not None])


def unpack(row: list[float], terms: int = 0) -> dict[str, Any]:
    """A packed row of `terms` loss terms by name: each of SCALARS a number, "terms" and each of
    PER_SEQUENCE a list."""
    out: dict[str, Any] = dict(zip(SCALARS, row[: len(SCALARS)], strict=True))
    out["terms"] = row[len(SCALARS) : len(SCALARS) + terms]
    rest = row[len(SCALARS) + terms :]
    n = len(rest) // len(PER_SEQUENCE)
    out.update({name: rest[i * n : (i + 1) * n] for i, name in enumerate(PER_SEQUENCE)})
    return out


@dataclass(kw_only=True)
class RankRow:
    """A rank's (or replica's) row as the host reads it."""

    loss_sum: float
    tokens: float
    norm_sq: float
    order: int
    load_s: float | None
    wait_s: float | None
    step_s: float | None
    sequences: list[dict]  # index, tokens, token-mean loss (None without tokens), content
    terms: list[float] = field(default_factory=list)  # its shares of the model's loss terms

    @classmethod
    def of(cls, row: dict[str, Any]) -> RankRow:
        """From `unpack`'s (or `fold_replicas`') fields: NaN times as None, integers as int."""
        times = {
            key: None if math.isnan(row[key]) else row[key]
            for key in ("load_s", "wait_s", "step_s")
        }
        sequences = [
            {"index": int(i), "tokens": int(t), "loss": s / t if t > 0 else None, "content": c}
            for s, t, i, c in zip(*(row[name] for name in PER_SEQUENCE), strict=True)
        ]
        head = {"loss_sum": row["loss_sum"], "tokens": row["tokens"], "norm_sq": row["norm_sq"]}
        terms = list(row.get("terms", []))
        return cls(**head, order=int(row["order"]), **times, sequences=sequences, terms=terms)


def _known(part: list[dict[str, Any]], key: str) -> list[float]:
    """The pieces' times under `key` that are known (not NaN)."""
    return [r[key] for r in part if not math.isnan(r[key])]


def _aligned(i: int, j: int, copies: int) -> bool:
    """Whether ranks i and j hold the same slices of a tensor split of `copies` ranks (innermost)."""
    return i % copies == j % copies


def fold_replicas(
    rows: list[dict[str, Any]],
    gram: list[list[float]],
    split: int,
    exact_norms: bool,
    copies: int = 1,
) -> tuple[list[dict[str, Any]], list[list[float]]]:
    """Rows (`unpack`'s) and Gram of the ranks as one row per replica, which the diagnostics
    compare. A replica is split x copies consecutive ranks: `split` pieces of each sequence (a
    sequence split), each piece on `copies` ranks that read its tokens and split the model's
    tensors (a tensor split, innermost). Its tokens and losses are those of one copy of each
    piece, summed (the content fingerprints are linear in the tokens); its gradient is every
    rank's part (each rank's own slices; the probe counts what the split replicates on one copy),
    so its Gram is the block sums (`exact_norms`: the diagonal from each rank's exact norm), over
    the pairs of ranks at the same place on the tensor split: the others hold disjoint slices,
    whose inner products are 0 (a sketch's estimates of them are noise only). A replica loads as
    slowly as its slowest rank and waits as briefly as its latest."""
    size = split * copies
    if size == 1:
        return rows, gram
    blocks = [range(a, a + size) for a in range(0, len(rows), size)]
    folded = []
    for block in blocks:
        part = [rows[i] for i in block]
        pieces = part[::copies]  # the first copy of each piece
        cross = sum(gram[i][j] for i in block for j in block if i != j and _aligned(i, j, copies))
        own = sum(r["norm_sq"] for r in part) if exact_norms else sum(gram[i][i] for i in block)
        summed = ("sequence_loss_sums", "sequence_tokens", "sequence_content")
        folded.append(
            {
                "loss_sum": sum(r["loss_sum"] for r in pieces),
                "tokens": sum(r["tokens"] for r in pieces),
                "norm_sq": own + cross,
                "order": part[0]["order"],
                "load_s": max(_known(part, "load_s"), default=math.nan),
                "wait_s": min(_known(part, "wait_s"), default=math.nan),
                "step_s": max(_known(part, "step_s"), default=math.nan),
                "sequence_index": part[0]["sequence_index"],
                "terms": [sum(v) for v in zip(*(r.get("terms", []) for r in pieces), strict=True)],
                **{f: [sum(v) for v in zip(*(r[f] for r in pieces), strict=True)] for f in summed},
            }
        )
    replica_gram = [
        [sum(gram[i][j] for i in a for j in b if _aligned(i, j, copies)) for b in blocks]
        for a in blocks
    ]
    return folded, replica_gram
