"""The statistical rules behind the named alerts: one small function per rule, each a check past
the burn-in in one alert's record (titanlite.diagnostics.catalogue).

A rule reads a `Window` (the measured step reduced to a `Point`, the points before it, the
thresholds of the [alerts] section) and returns a `Finding` or None; the runner
(titanlite.diagnostics.alerts) adds the cooldown, the hosts and the cause.
"""

from __future__ import annotations

import math
import statistics

from titanlite.config.job_config import Alerts as AlertsConfig
from titanlite.diagnostics import rank_sum
from titanlite.diagnostics.window import SPREAD_RANKS, Finding, Window

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
    if world >= 2 and not rank_sum.reachable(per_rank, world, cfg.rank_test_window, cfg.rank_test_alpha):
        notes.append(
            f"single_rank_outlier's per-sample test cannot fire with {per_rank} sequence(s) per rank per step "
            f"at dp={world} (it needs more within alerts.rank_test_window = {cfg.rank_test_window} measured "
            "steps): a bad batch on one rank is named later, by persistence, if at all"
        )
    return "; ".join(notes) or None


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
    """The Loss Dispersion manual's critical warning. Dispersion grows naturally for a long time
    while the model learns, so the rule has its own, longer burn-in; a drift is a long trend and
    the std over a few ranks is noisy from step to step, so it compares medians of thirds of a
    long window (means of thirds of the alert window raise it in healthy runs). What healthy
    runs measured, both ways: titanlite/diagnostics/README.md, on the trend rule."""
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
    hit = w.persistent("max_rank", "gap")
    if not hit or hit[2] <= w.cfg.outlier_margin:
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
    if not cos_past or statistics.median(cos_past) <= w.cfg.cos_high or cos is None or cos >= w.cfg.cos_low:
        return None
    msg = (
        f"mean pairwise gradient cosine fell to {cos:.3f} from a median of {statistics.median(cos_past):.3f}"
    )
    return Finding("cosine_drop", [], msg, {"cos": cos})


def faulty_worker_direction(w: Window) -> Finding | None:
    """One rank's gradient persistently disagrees with the others'."""
    hit = w.persistent("low_rank", "low_margin")
    if not hit or hit[2] <= w.cfg.faulty_margin:
        return None
    low, n, margin = hit
    msg = (
        f"rank {low} had the lowest gradient cosine to the other ranks in {n} of the "
        f"last {len(w.pts)} measured steps, {margin:.3f} below their median"
    )
    return Finding("faulty_worker", [low], msg, {"share": n / len(w.pts)})


def faulty_worker_norm(w: Window) -> Finding | None:
    """One rank's gradient norm persistently stands apart."""
    hit = w.persistent("big_rank", "big_ratio")
    if not hit or hit[2] <= w.cfg.norm_outlier_factor:
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
    not (what moves every rank, a learning-rate change say, is the trend). Needs no third rank:
    at dp = 2 a comparison across ranks cannot say which of two is off, a rank's own history can.
    The noise per token, not the norm: a rank's token-mean gradient from few valid tokens (an SFT
    step that handed it short answers) is larger by chance alone, by sqrt(tokens) in the noise."""
    rises, limit = noise_rises(w), math.log(w.cfg.norm_outlier_factor)
    for r in sorted((r for r, x in enumerate(rises) if x is not None), key=lambda r: -rises[r]):
        others = [x for j, x in enumerate(rises) if j != r and x is not None]
        if rises[r] < limit or not others or w.explained(None, r):
            continue
        trend = statistics.median(others)
        if rises[r] - trend >= limit:
            # the others' estimate subtracts the step's gradient, which this rank's noise now fills
            theirs = (
                f"{math.exp(trend):.2f}x" if trend > -math.inf else "~0 (its noise fills the step's gradient)"
            )
            others_are = "the other rank's" if w.world == 2 else "the other ranks'"
            msg = (
                f"rank {r}'s gradient noise per token (its gradient norm with its token count taken out) rose to "
                f"{math.exp(rises[r]):.1f}x its own median of the {len(w.pts) - w.cfg.own_recent} measured steps "
                f"before, {others_are} {theirs}"
            )
            return Finding("faulty_worker", [r], msg, {"rise": math.exp(rises[r]), "trend": math.exp(trend)})
    return None


def faulty_worker_norm_pair(w: Window) -> Finding | None:
    """dp = 2, the norms a multiple apart throughout the window and no rank named for it yet (a
    fault there from the start: no history in which they agreed). Which of two is off cannot be
    told from their norms (noise adds to a gradient; a gradient that vanished lowers one), so both
    are named."""
    if w.world != 2 or w.named.get("faulty_worker") or w.explained(None, None):
        return None
    pairs = [q.rank_norm for q in w.pts if q.rank_norm and None not in q.rank_norm and min(q.rank_norm) > 0]
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
