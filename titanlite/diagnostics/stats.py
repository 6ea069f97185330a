r"""Diagnostics metrics of one measured step, from what every rank contributed. S_r: rank r's
summed cross entropy, n_r its valid tokens (N their sum), q_r = ||h_r||^2 with
h_r = \sum_m \nabla S_{r,m} / N its contribution to the reduction, G the Gram of the h_r. Rank r's
token-mean loss is S_r / n_r and its gradient norm ||g_r|| = sqrt(q_r) N / n_r; cosines come from
G alone. A rank much larger than the others dominates the sum and looks aligned with it, so each
rank's cosine to the sum of the *other* ranks is kept too. A rank with no valid token is left out
(counted in `empty_ranks`). Dispersions are population statistics (1/N), as the Loss Dispersion
Reference Manual defines them (on the metrics of arXiv 2602.14462)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

# Ranks up to which a record keeps every pair's cosine (cos_matrix, W^2 values); beyond, each
# rank's summaries (its cosine to the mean, to the others, its median to the others).
PAIRS_KEPT = 64


def _pstd(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))


def term_metrics(names: list[str], shares: list[list[float]], tokens: list[float]) -> dict:
    """The loss terms a model adds, per rank as rank_loss is the cross entropy: rank r's share
    of term k (its per-sequence sums over N) as a token mean, shares[r][k] N / n_r
    (`rank_terms`, None without tokens), and their spread over the ranks with tokens
    (`term_<name>_std`). {} when the model adds none."""
    if not names:
        return {}
    total = sum(tokens)
    live = [r for r in range(len(tokens)) if tokens[r] > 0]
    out: dict = {"rank_terms": {}}
    for k, name in enumerate(names):
        per_rank = [
            s[k] * total / n if n > 0 else None for s, n in zip(shares, tokens, strict=True)
        ]
        out["rank_terms"][name] = per_rank
        if live:
            out[f"term_{name}_std"] = _pstd([per_rank[r] for r in live])
    return out


def step_metrics(
    loss_sums: list[float],
    tokens: list[float],
    norms_sq: list[float] | None,
    gram: list[list[float]] | None,
) -> dict:
    """All per-step diagnostics (see module doc): per-rank vectors in full, every pair's cosine
    up to PAIRS_KEPT ranks. The Gram's work is numpy arithmetic on the host (never a device
    tensor, so no host sync), and rank 0's host time stays under a second at thousands of ranks
    (scripts/rehearse_sweep.py measures it)."""
    world = len(tokens)
    total = sum(tokens)
    live = [r for r in range(world) if tokens[r] > 0]
    losses = [loss_sums[r] / tokens[r] if tokens[r] > 0 else None for r in range(world)]
    live_losses = [losses[r] for r in live]
    m: dict = {
        "rank_loss": losses,
        "rank_tokens": [int(t) for t in tokens],
        "empty_ranks": world - len(live),
        "tokens_min": int(min(tokens)),
        "tokens_max": int(max(tokens)),
        "tokens_std": _pstd(tokens),
    }
    if live:
        m.update(
            loss_std=_pstd(live_losses),
            loss_range=max(live_losses) - min(live_losses),
            loss_max_rank=max(live, key=losses.__getitem__),
            loss_min_rank=min(live, key=losses.__getitem__),
        )
    if norms_sq is None or gram is None or not live:
        return m
    norms = [
        math.sqrt(max(norms_sq[r], 0.0)) * total / tokens[r] if tokens[r] > 0 else None
        for r in range(world)
    ]
    live_norms = [norms[r] for r in live]
    mean_norm = sum(live_norms) / len(live_norms)
    m.update(
        rank_grad_norm=norms,
        grad_norm_mean=mean_norm,
        grad_norm_std=_pstd(live_norms),
        grad_norm_cv=_pstd(live_norms) / mean_norm if mean_norm > 0 else float("nan"),
        grad_norm_range=max(live_norms) - min(live_norms),
        grad_norm_max_rank=max(live, key=norms.__getitem__),
    )
    g = np.asarray(gram, dtype=np.float64)
    own = np.diagonal(g).copy()
    diag = np.sqrt(np.clip(own, 0.0, None))
    ok = np.array([t > 0 for t in tokens]) & (diag > 0)
    pair_ok = ok[:, None] & ok[None, :]
    total_sq, row = g.sum(), g.sum(1)
    others_sq = total_sq - 2 * row + own  # the Gram's sum over every pair but rank r's
    with np.errstate(divide="ignore", invalid="ignore"):  # masked out below
        cos = np.where(pair_ok, g / (diag[:, None] * diag[None, :]), np.nan)
        to_mean = row / (diag * np.sqrt(max(total_sq, 0.0)))
        to_others = (row - own) / (diag * np.sqrt(np.abs(others_sq)))
    to_mean = _listed(np.where(ok & (total_sq > 0), to_mean, np.nan))
    to_others = _listed(np.where(ok & (others_sq > 0), to_others, np.nan))
    pairs = cos[np.triu(pair_ok, k=1)]
    has_cos = [r for r in live if to_mean[r] is not None]
    live_cos = [to_mean[r] for r in has_cos]
    m.update(
        cos_mean_pairwise=float(pairs.mean()) if pairs.size else None,
        rank_cos_to_mean=to_mean,
        cos_to_mean_min=min(live_cos) if live_cos else None,
        cos_to_mean_min_rank=min(has_cos, key=to_mean.__getitem__) if live_cos else None,
        rank_cos_to_others=to_others,
        rank_cos_median=cos_medians(cos, live),
        rank_noise=rank_noise(norms, tokens, cos),
    )
    if world <= PAIRS_KEPT:
        m["cos_matrix"] = [_listed(r) for r in cos]
    return m


def _listed(values: np.ndarray) -> list[float | None]:
    """A vector as a record's list: NaN (no value) as None."""
    return [None if v != v else v for v in values.tolist()]


def cos_medians(cos: np.ndarray | list, live: list[int]) -> list[float | None]:
    """Each live rank's median cosine to the other live ranks (the mean of the two middle values
    of an even count, as statistics.median); None without any. A record's None reads NaN."""
    c = np.asarray(cos, dtype=np.float64)
    world = c.shape[0]
    in_live = np.zeros(world, dtype=bool)
    in_live[live] = True
    mask = in_live[:, None] & in_live[None, :] & ~np.eye(world, dtype=bool) & ~np.isnan(c)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a row without values: None below
        med = np.nanmedian(np.where(mask, c, np.nan), axis=1)
    return [float(med[r]) if in_live[r] and mask[r].any() else None for r in range(world)]


def rank_noise(norms: list, tokens: list, cos: np.ndarray | list) -> list[float | None]:
    r"""Each rank's gradient noise per token, sqrt(tr(\Sigma)) estimated from its own gradient:
    its norm with its token count taken out, so that a rank handed few valid tokens (SFT) does not
    look noisy. With E||g_r||^2 = |G|^2 + tr(\Sigma)/n_r and E||G_N||^2 = |G|^2 + tr(\Sigma)/N
    (NoiseScale's model), tr(\Sigma) = (||g_r||^2 - ||G_N||^2) / (1/n_r - 1/N), where
    ||G_N||^2 = ||\sum_r h_r||^2 = \sum_ij cos_ij ||g_i|| ||g_j|| n_i n_j / N^2. An estimate below
    0 (chance, or another rank's noise filling G_N) reads 0; None for a rank without tokens, and
    for all when fewer than 2 ranks have them or a cosine is missing."""
    live = [r for r, n in enumerate(tokens) if n > 0 and norms[r] is not None]
    total = sum(tokens[r] for r in live)
    c = np.asarray(cos, dtype=np.float64)[np.ix_(live, live)] if len(live) >= 2 else None
    if c is None or np.isnan(c).any():
        return [None] * len(tokens)
    weighted = np.array([norms[r] * tokens[r] / total for r in live], dtype=np.float64)  # ||h_r||
    global_sq = float(weighted @ c @ weighted)
    out: list[float | None] = [None] * len(tokens)
    for r in live:
        out[r] = math.sqrt(max(norms[r] ** 2 - global_sq, 0.0) / (1 / tokens[r] - 1 / total))
    return out


@dataclass
class NoiseScale:
    r"""Simple gradient noise scale B_simple = tr(\Sigma) / |G|^2 in tokens ("An Empirical Model of
    Large-Batch Training", McCandlish et al., arXiv 1812.06162, appendix A). For a gradient
    averaged over b iid tokens, E||g_b||^2 = |G|^2 + tr(\Sigma) / b; rank r has b = n_r and the
    step b = N, so with q = mean_r(1/n_r) (1/B_small at equal counts, the appendix's case)
        tr(\Sigma) = (mean_r ||g_r||^2 - ||G_N||^2) / (q - 1/N),   |G|^2 = ||G_N||^2 - tr(\Sigma)/N,
    each smoothed by EMA before the ratio, as that appendix advises (both are noisy per step)."""

    decay: float = 0.9
    trace_ema: float | None = None
    gsq_ema: float | None = None

    def update(
        self, rank_norms_sq: list[float], rank_tokens: list[float], global_norm_sq: float
    ) -> float | None:
        live = [(g, n) for g, n in zip(rank_norms_sq, rank_tokens, strict=True) if n > 0]
        if len(live) < 2:
            return self.value
        total = sum(n for _, n in live)
        q = sum(1.0 / n for _, n in live) / len(live)
        if q - 1.0 / total <= 0:
            return self.value
        trace = (sum(g for g, _ in live) / len(live) - global_norm_sq) / (q - 1.0 / total)
        gsq = global_norm_sq - trace / total
        if self.trace_ema is None:
            self.trace_ema, self.gsq_ema = trace, gsq
        else:
            self.trace_ema = self.decay * self.trace_ema + (1 - self.decay) * trace
            self.gsq_ema = self.decay * self.gsq_ema + (1 - self.decay) * gsq
        return self.value

    @property
    def value(self) -> float | None:
        if self.trace_ema is None or self.gsq_ema is None or self.gsq_ema <= 0:
            return None
        return self.trace_ema / self.gsq_ema
