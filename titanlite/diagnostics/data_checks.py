"""Exact checks of what the ranks read, from a measured step's per-sequence records.

Each rank reports per sequence the dataset index its sampler assigned and a fingerprint of the
tokens its loader delivered, plus a hash of the whole global batch as its sampler orders it.
Three faults show as equalities, with no threshold and no burn-in:
- identical_data: two ranks were handed the same sequences (the "rank not passed to the
  loader" bug), at the first measured step;
- stale_batch: a rank's tokens are those of its previous measured step although its sampler
  assigned other sequences (a reader stuck on a stale buffer), at the second;
- data_order_mismatch: the ranks' samplers order the global batch differently (per-rank shuffle
  seeds: S1-2 / S1-3 of "Silent Inconsistency in Data-Parallel Full Fine-Tuning", arXiv
  2602.14462), so some sequences are read twice and others never, at the first.
Sequences that legitimately repeat do not trip them: a dataset's duplicate documents have other
indices (identical_data compares indices), and stale_batch needs every sequence of a rank to
repeat, under new indices, at two measured steps in a row.
"""

from __future__ import annotations

import torch

_WEIGHTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def content_fingerprint(tokens: torch.Tensor) -> torch.Tensor:
    """[batch, seq] token ids -> [batch] float64: a fixed random weighting of each row, equal for
    equal rows (the same reduction on the same device), different otherwise with probability ~1."""
    key = (tokens.shape[-1], tokens.device)
    if key not in _WEIGHTS:
        g = torch.Generator().manual_seed(0x5EED)
        _WEIGHTS[key] = (1 + torch.rand(tokens.shape[-1], generator=g, dtype=torch.float64)).to(tokens.device)
    return (tokens.double() * _WEIGHTS[key]).sum(-1)


def read(rec: dict) -> list[list[list[float]]] | None:
    """Per rank: [dataset indices, content fingerprints] of a measured step's sequences (None for a
    record without them)."""
    samples = rec.get("rank_samples")
    if not samples or rec.get("data_order") is None:
        return None
    return [[[s["index"] for s in rank], [s["content"] for s in rank]] for rank in samples]


def identical(now: list[list[list[float]]]) -> tuple[list[int], str] | None:
    """identical_data: ranks handed the same sequences as a lower rank."""
    copies = [r for r in range(len(now)) if now[r][0] and any(now[r][0] == now[q][0] for q in range(r))]
    if not copies:
        return None
    first = next(q for q in range(copies[0]) if now[q][0] == now[copies[0]][0])
    return copies, (
        f"rank(s) {copies} were handed the same sequences as rank {first} (indices {now[copies[0]][0][:4]}...)"
    )


def stale(now: list[list[list[float]]], prev: list[list[list[float]]] | None) -> tuple[list[int], str] | None:
    """stale_batch: ranks whose tokens are their previous measured step's under new indices."""
    if prev is None or len(prev) != len(now):
        return None
    ranks = [
        r
        for r, ((ids, content), (old_ids, old_content)) in enumerate(zip(now, prev, strict=True))
        if content and content == old_content and ids != old_ids
    ]
    if not ranks:
        return None
    return ranks, (
        f"rank(s) {ranks} trained on the same tokens as at their previous measured step "
        "although their sampler assigned other sequences"
    )


def order_mismatch(orders: list[int]) -> tuple[list[int], str] | None:
    """data_order_mismatch: the ranks whose sampler orders the global batch unlike the majority
    (every rank when there is none)."""
    counts: dict[float, int] = {}
    for h in orders:
        counts[h] = counts.get(h, 0) + 1
    if len(counts) < 2:
        return None
    common, n = max(counts.items(), key=lambda kv: kv[1])
    majority = n > len(orders) / 2
    odd = [r for r, h in enumerate(orders) if h != common] if majority else list(range(len(orders)))
    return odd, (
        f"the samplers of rank(s) {odd} order the global batch differently from "
        f"{'the other ranks' if majority else 'each other'} ({len(counts)} different orders among {len(orders)} ranks)"
    )
