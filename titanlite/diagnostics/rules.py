"""The rules behind the named alerts, each a check in one alert's record (catalogue.py). The exact
data checks compare each sequence's dataset index and content fingerprint and the sampler's hash
of the batch order, with no threshold and no burn-in (data_order_mismatch: S1-2 / S1-3 of "Silent
Inconsistency in Data-Parallel Full Fine-Tuning", arXiv 2602.14462); a dataset's duplicate
documents have other indices, so they do not trip them. The statistical rules read a `Window`."""

from __future__ import annotations

import math
import statistics
from collections import Counter

from titanlite.config.job_config import Alerts as AlertsConfig
from titanlite.diagnostics import rank_sum
from titanlite.diagnostics.registry import SPREAD_RANKS, Finding, Window

NEED_SPREAD = ("dispersion_spike", "dispersion_rising_loss_falling", "faulty_worker (by direction)")
SPREAD_ONLY = NEED_SPREAD[:2]  # the alerts that have no other check: silent at dp=2


def silent_rules_note(world: int, per_rank: int, cfg: AlertsConfig) -> str | None:
    """What a start-up note says when the data-parallel world, or the sequences each rank scores
    per step (`per_rank`), are too few for some rules."""
    notes = []
    if world == 2:
        notes.append(
            f"with 2 data-parallel ranks the alerts that compare ranks with each other ({', '.join(NEED_SPREAD)}) "
            f"need {SPREAD_RANKS} or more and stay off; each rank is still checked against its own history"
        )
    window = cfg.rank_test_window
    if world >= 2 and not rank_sum.reachable(per_rank, world, window, cfg.rank_test_alpha):
        notes.append(
            f"single_rank_outlier's per-sample test cannot fire with {per_rank} sequence(s) per rank per step "
            f"at dp={world} (it needs more within alerts.rank_test_window = {window} measured "
            "steps): a bad batch on one rank is named later, by persistence, if at all"
        )
    return "; ".join(notes) or None


def read(rec: dict) -> list[list[list[float]]] | None:
    """Per rank: [dataset indices, content fingerprints] of a measured step's sequences (None for a
    record without them)."""
    samples = rec.get("rank_samples")
    if not samples or rec.get("data_order") is None:
        return None
    return [[[s["index"] for s in rank], [s["content"] for s in rank]] for rank in samples]


def identical(now: list[list[list[float]]]) -> Finding | None:
    """identical_data: ranks handed the same sequences as a lower rank."""
    copies = [
        r for r in range(len(now)) if now[r][0] and any(now[r][0] == now[q][0] for q in range(r))
    ]
    if not copies:
        return None
    first = next(q for q in range(copies[0]) if now[q][0] == now[copies[0]][0])
    msg = f"rank(s) {copies} were handed the same sequences as rank {first} (indices {now[copies[0]][0][:4]}...)"
    return Finding("identical_data", copies, msg)


def stale(now: list[list[list[float]]], prev: list[list[list[float]]] | None) -> Finding | None:
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
    msg = f"rank(s) {ranks} trained on the same tokens as at their previous measured step although their sampler assigned other sequences"
    return Finding("stale_batch", ranks, msg)


def order_mismatch(orders: list[int]) -> Finding | None:
    """data_order_mismatch: the ranks whose sampler orders the global batch unlike the majority
    (every rank when there is none)."""
    counts = Counter(orders)
    if len(counts) < 2:
        return None
    common, n = counts.most_common(1)[0]
    majority = n > len(orders) / 2
    odd = [r for r, h in enumerate(orders) if h != common] if majority else list(range(len(orders)))
    others = "the other ranks" if majority else "each other"
    msg = f"the samplers of rank(s) {odd} order the global batch differently from {others} ({len(counts)} different orders among {len(orders)} ranks)"
    return Finding("data_order_mismatch", odd, msg)


# How far a rank's gradient norm may sit from the ranks' median and still count as the same
# value: each rank holds the result of the same all-reduces, so they agree to the bit unless a
# reduction differs; a few float32 ulps leave room for a backend that reduces in another order.
SHARED_NORM_RTOL = 1e-6
_SHARED_LABELS = {
    "tokens": "global token count",
    "grad_norm": "gradient norm (so its clip factor)",
    "skip": "skip flag",
}


def _odd_ranks(values: list[float], rtol: float) -> list[int]:
    """The ranks whose value is not the others' median within `rtol` (NaN matches only NaN);
    every rank when half or more differ (no majority)."""
    known = [v for v in values if not math.isnan(v)]
    if not known:
        return []
    ref = statistics.median_low(known)
    nan_wins = 2 * (len(values) - len(known)) > len(values)
    odd = [
        r
        for r, v in enumerate(values)
        if (not math.isnan(v) if nan_wins else math.isnan(v) or abs(v - ref) > rtol * abs(ref))
    ]
    return list(range(len(values))) if odd and 2 * len(odd) >= len(values) else odd


def shared_mismatch(shared: dict[str, list[float]] | None, replica_ranks: int) -> Finding | None:
    """shared_scalar_mismatch: ranks (of the whole job, tensor-parallel ranks included) whose value
    of the step's global token count, gradient norm or skip flag (`shared`: each name's value per
    rank, step_record.SHARED) differs from the others'. Names the replicas that hold them; the
    message names the ranks."""
    if not shared:
        return None
    odd: set[int] = set()
    parts = []
    for name, values in shared.items():
        ranks = _odd_ranks(values, SHARED_NORM_RTOL if name == "grad_norm" else 0.0)
        if not ranks:
            continue
        odd.update(ranks)
        rest = [v for r, v in enumerate(values) if r not in ranks]
        theirs = ", ".join(f"{values[r]:.6g}" for r in ranks[:8]) + (
            " ..." if len(ranks) > 8 else ""
        )
        others = (
            f"the other {len(rest)} rank(s) {statistics.median_low(rest):.6g}"
            if rest
            else "no two alike"
        )
        parts.append(f"{_SHARED_LABELS.get(name, name)}: rank(s) {ranks} hold {theirs}, {others}")
    if not odd:
        return None
    ranks = sorted(odd)
    replicas = sorted({r // replica_ranks for r in ranks})
    where = f" (of replica(s) {replicas})" if replica_ranks > 1 else ""
    msg = f"ranks disagree on what every rank must share{where}: " + "; ".join(parts)
    return Finding("shared_scalar_mismatch", replicas, msg, {"ranks": ranks})


def dispersion_spike(w: Window) -> Finding | None:
    """The loss dispersion jumps while the global loss stays smooth."""
    p, c = w.p, w.cfg
    ref_std = statistics.median(q.loss_std for q in w.past)
    ref_loss = statistics.median(q.loss for q in w.past[-5:])
    if (
        p.ranks < SPREAD_RANKS
        or ref_std <= 0
        or p.loss_std <= c.spike_factor * ref_std
        or abs(p.loss - ref_loss) >= c.smooth_loss_tol * ref_loss
    ):
        return None
    msg = f"loss dispersion {p.loss_std:.4f} is {p.loss_std / ref_std:.1f}x its recent median while the global loss is smooth"
    return Finding("dispersion_spike", [], msg, {"loss_std": p.loss_std, "median": ref_std})


def dispersion_rising_loss_falling(w: Window) -> Finding | None:
    """The Loss Dispersion manual's critical warning. Dispersion grows naturally while the model
    learns, so it has a longer burn-in, and compares medians of thirds of a long window (the std
    over a few ranks is noisy; titanlite/diagnostics/README.md, on the trend rule)."""
    c = w.cfg
    if w.p.ranks < SPREAD_RANKS or w.seen <= c.trend_burn_in or len(w.trend) < c.trend_window:
        return None
    third = max(1, c.trend_window // 3)
    first, last = w.trend[:third], w.trend[-third:]
    std_a, std_b = (statistics.median(s for _, s in part) for part in (first, last))
    loss_a, loss_b = (statistics.median(loss for loss, _ in part) for part in (first, last))
    if std_a <= 0 or std_b <= (1 + c.trend_rise) * std_a or loss_b >= loss_a:
        return None
    msg = f"loss dispersion rose {std_a:.4f} -> {std_b:.4f} while the global loss fell {loss_a:.4f} -> {loss_b:.4f}"
    return Finding("dispersion_rising_loss_falling", [], msg, {"std_from": std_a, "std_to": std_b})


def single_rank_outlier(w: Window) -> Finding | None:
    """One rank has the highest loss, by a margin, in most of the window."""
    hit = w.persistent("max_rank", "gap", w.cfg.outlier_margin)
    if not hit:
        return None
    top, n, gap = hit
    msg = f"rank {top} had the highest loss in {n} of the last {len(w.pts)} measured steps, {100 * gap:.1f}% above the others"
    return Finding("single_rank_outlier", [top], msg, {"share": n / len(w.pts)})


def identical_data(w: Window) -> Finding | None:
    """The ranks are indistinguishable throughout: the same data (unless the exact check, which
    names the ranks, already says so)."""
    c = w.cfg
    recent = w.pts[-c.min_steps :]
    if w.explained("identical_data", None) or not all(
        q.loss_std <= c.identical_std * q.loss or (q.cos is not None and q.cos > c.identical_cos)
        for q in recent
    ):
        return None
    msg = f"loss dispersion ~0 or gradient cosine > {c.identical_cos} for {len(recent)} measured steps"
    return Finding("identical_data", [], msg, {"loss_std": w.p.loss_std, "cos": w.p.cos})


def cosine_drop(w: Window) -> Finding | None:
    """Alignment collapsing: typically above cos_high, now near 0 or below."""
    cos_past = [q.cos for q in w.past if q.cos is not None]
    cos = w.p.cos
    if not cos_past or cos is None or cos >= w.cfg.cos_low:
        return None
    median = statistics.median(cos_past)
    if median <= w.cfg.cos_high:
        return None
    msg = f"mean pairwise gradient cosine fell to {cos:.3f} from a median of {median:.3f}"
    return Finding("cosine_drop", [], msg, {"cos": cos})


def faulty_worker_direction(w: Window) -> Finding | None:
    """One rank's gradient persistently disagrees with the others'."""
    hit = w.persistent("low_rank", "low_margin", w.cfg.faulty_margin)
    if not hit:
        return None
    low, n, margin = hit
    msg = (
        f"rank {low} had the lowest gradient cosine to the other ranks in {n} of the "
        f"last {len(w.pts)} measured steps, {margin:.3f} below their median"
    )
    return Finding("faulty_worker", [low], msg, {"share": n / len(w.pts)})


def faulty_worker_norm(w: Window) -> Finding | None:
    """One rank's gradient norm persistently stands apart."""
    hit = w.persistent("big_rank", "big_ratio", w.cfg.norm_outlier_factor)
    if not hit:
        return None
    big, n, ratio = hit
    msg = (
        f"rank {big} had the largest gradient norm in {n} of the last {len(w.pts)} "
        f"measured steps, {ratio:.1f}x the others' median"
    )
    return Finding("faulty_worker", [big], msg, {"share": n / len(w.pts)})


def noise_rises(w: Window) -> list[float | None]:
    """Per rank: log of its gradient noise per token (stats.rank_noise: its norm with its token
    count taken out) over the last own_recent measured steps, over its median over the window's
    steps before them (None without both; an estimate of 0 counts as a fall far below any limit)."""
    pts, k = w.pts, w.cfg.own_recent
    if len(pts) <= k or any(q.rank_noise is None for q in pts):
        return [None] * w.world
    rises = []
    for r in range(w.world):
        now = [q.rank_noise[r] for q in pts[-k:] if q.rank_noise[r] is not None]
        before = [q.rank_noise[r] for q in pts[:-k] if q.rank_noise[r] is not None]
        if not now or not before or statistics.median(before) <= 0:
            rises.append(None)
            continue
        ratio = statistics.median(now) / statistics.median(before)
        rises.append(math.log(ratio) if ratio > 0 else -math.inf)
    return rises


def faulty_worker_norm_rise(w: Window) -> Finding | None:
    """One rank's gradient noise rises to a multiple of its own history while the others' does
    not (what moves every rank is the trend). Works at dp = 2. The noise per token, not the norm:
    a rank handed few valid tokens (SFT) has a larger token-mean gradient by chance alone."""
    rises, limit = noise_rises(w), math.log(w.cfg.norm_outlier_factor)
    for r in sorted((r for r, x in enumerate(rises) if x is not None), key=lambda r: -rises[r]):
        others = [x for j, x in enumerate(rises) if j != r and x is not None]
        if rises[r] < limit or not others or w.explained(None, r):
            continue
        trend = statistics.median(others)
        if rises[r] - trend >= limit:
            # the others' estimate subtracts the step's gradient, which this rank's noise now fills
            theirs = (
                f"{math.exp(trend):.2f}x"
                if trend > -math.inf
                else "~0 (its noise fills the step's gradient)"
            )
            others_are = "the other rank's" if w.world == 2 else "the other ranks'"
            msg = (
                f"rank {r}'s gradient noise per token (its gradient norm with its token count taken out) rose to "
                f"{math.exp(rises[r]):.1f}x its own median of the {len(w.pts) - w.cfg.own_recent} measured steps "
                f"before, {others_are} {theirs}"
            )
            return Finding(
                "faulty_worker", [r], msg, {"rise": math.exp(rises[r]), "trend": math.exp(trend)}
            )
    return None


def faulty_worker_norm_pair(w: Window) -> Finding | None:
    """dp = 2, the norms a multiple apart throughout the window and no rank named for it yet (a
    fault from the start): which of two is off cannot be told from their norms, so both are named."""
    if w.world != 2 or w.named.get("faulty_worker") or w.explained(None, None):
        return None
    pairs = [
        q.rank_norm
        for q in w.pts
        if q.rank_norm and None not in q.rank_norm and min(q.rank_norm) > 0
    ]
    if len(pairs) < len(w.pts):
        return None
    big = [max((0, 1), key=n.__getitem__) for n in pairs]
    top = max((0, 1), key=big.count)
    apart = [n[top] / n[1 - top] for n, b in zip(pairs, big, strict=True) if b == top]
    hits = sum(x >= w.cfg.norm_outlier_factor for x in apart)
    if hits < w.cfg.persist_frac * len(pairs):
        return None
    ratio = statistics.median(apart)
    msg = (
        f"rank {top}'s gradient norm was {ratio:.1f}x rank {1 - top}'s in {hits} of the last {len(pairs)} measured "
        "steps, with no earlier steps where they agreed: with two ranks titanlite cannot tell which one is off "
        "(the larger usually is: noise adds to a gradient); a run with a third rank would say"
    )
    return Finding("faulty_worker", [0, 1], msg, {"ratio": ratio})


def batch_advice(kept: dict, rec: dict, cfg: AlertsConfig, unit: int) -> Finding | None:
    """batch_size_advice: the critical batch is about the gradient noise scale ("An Empirical
    Model of Large-Batch Training", McCandlish et al., arXiv 1812.06162), estimated by B_simple
    (stats.NoiseScale). It moves as training goes, so the advice comes only when its ratio to the
    batch stays past `advice_ratio` either way for `advice_steps` measured steps, and again only a
    further `advice_ratio`-fold on. `kept`: the alert's state; `unit`: the sequences the global
    batch moves by (dp x local)."""
    noise, tokens = rec.get("noise_scale_tokens"), rec.get("batch_tokens")
    sequences = rec.get("batch_sequences")
    # B_simple <= 0: the ranks' gradients agree beyond their noise (the same data, say), and
    # the estimate says nothing about the batch
    if noise is None or noise <= 0 or not tokens or not sequences:
        return None
    ratios, batches = kept["ratios"], kept["tokens"]
    batches.append(tokens)
    del batches[: -cfg.advice_steps]
    tokens = statistics.fmean(batches)  # an SFT batch's tokens vary by step
    ratios.append(noise / tokens)
    del ratios[: -cfg.advice_steps]
    r, ratio, before = cfg.advice_ratio, statistics.median(ratios), kept["advised_ratio"]
    side = 1 if ratio >= r else -1 if ratio <= 1 / r else 0
    if side == 0:
        kept["advised_ratio"] = 0.0  # back in the band: a later excursion is advised again
        return None
    edge = r if side > 0 else 1 / r
    if before and (before > 1) == (side > 0):  # advised this side: a further fold
        edge = before * r if side > 0 else before / r
    past = all((x - edge) * side >= 0 for x in ratios)
    if len(ratios) < cfg.advice_steps or not past:
        return None
    kept["advised_ratio"] = ratio
    per_seq = tokens / sequences
    suggest = max(unit, round(ratio * sequences / unit) * unit)
    flag = f"--training.global_batch_size {suggest}"
    head = (
        f"the gradient noise scale B_simple (McCandlish et al., arXiv 1812.06162) has been about "
        f"{ratio * tokens:,.0f} tokens for the last {len(ratios)} measured steps, "
    )
    if side > 0:
        msg = head + (
            f"{ratio:.0f}x this run's batch of {tokens:,.0f} tokens{_since(before)}: its steps are dominated by gradient noise, "
            "so a larger batch would reach a given loss in nearly proportionally fewer steps for about the "
            f"same tokens, up to about that size ({suggest} sequences of ~{per_seq:,.0f} tokens)"
        )
    else:
        msg = head + (
            f"1/{1 / ratio:.0f} of this run's batch of {tokens:,.0f} tokens{_since(before)}: past the noise scale extra batch "
            "buys little, so each step spends more tokens than its gradient needs, and a smaller batch would "
            f"reach a given loss with fewer tokens (in more steps): about {suggest} sequences"
        )
    msg += f"; the batch is part of the run's identity, so this is for the next run: {flag} (re-tune the learning rate)"
    values = {
        "noise_scale_tokens": ratio * tokens,
        "batch_tokens": tokens,
        "suggested_global_batch": suggest,
    }
    return Finding("batch_size_advice", [], msg, values)


def _since(before: float) -> str:
    """The ratio of an earlier advice in this excursion, as the message says it."""
    if not before:
        return ""
    shown = f"{before:.0f}x" if before >= 1 else f"1/{1 / before:.0f}"
    return f" (advised at {shown} before)"
