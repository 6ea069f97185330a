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


class DataChecks:
    """Compares each measured step with the ranks' records of their previous measured step."""

    def __init__(self) -> None:
        self.prev: list[list[list[float]]] | None = None  # per rank: [indices, fingerprints]

    def state_dict(self) -> dict:
        return {"prev": self.prev}

    def load_state_dict(self, state: dict) -> None:
        self.prev = state.get("prev")

    def update(self, rec: dict) -> list[tuple[str, list[int], str]]:
        """(alert name, ranks, message) for every check this step fails."""
        samples, orders = rec.get("rank_samples"), rec.get("data_order")
        if not samples or orders is None:
            return []
        now = [[[s["index"] for s in rank], [s["content"] for s in rank]] for rank in samples]
        out = []
        copies = [r for r in range(len(now)) if now[r][0] and any(now[r][0] == now[q][0] for q in range(r))]
        if copies:
            first = next(q for q in range(copies[0]) if now[q][0] == now[copies[0]][0])
            out.append(
                (
                    "identical_data",
                    copies,
                    f"rank(s) {copies} were handed the same sequences as rank {first} "
                    f"(indices {now[copies[0]][0][:4]}...)",
                )
            )
        if self.prev is not None and len(self.prev) == len(now):
            stale = [
                r
                for r, ((ids, content), (old_ids, old_content)) in enumerate(zip(now, self.prev, strict=True))
                if content and content == old_content and ids != old_ids
            ]
            if stale:
                out.append(
                    (
                        "stale_batch",
                        stale,
                        f"rank(s) {stale} trained on the same tokens as at their previous measured step "
                        "although their sampler assigned other sequences",
                    )
                )
        counts: dict[float, int] = {}
        for h in orders:
            counts[h] = counts.get(h, 0) + 1
        if len(counts) > 1:
            common, n = max(counts.items(), key=lambda kv: kv[1])
            odd = (
                [r for r, h in enumerate(orders) if h != common]
                if n > len(orders) / 2
                else list(range(len(orders)))
            )
            out.append(
                (
                    "data_order_mismatch",
                    odd,
                    f"the samplers of rank(s) {odd} order the global batch differently from "
                    f"{'the other ranks' if n > len(orders) / 2 else 'each other'} "
                    f"({len(counts)} different orders among {len(orders)} ranks)",
                )
            )
        self.prev = now
        return out
