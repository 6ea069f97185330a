r"""The per-sample rank test: is one rank's data worse (or better) than the rest of its step? The
sampler cuts each step's permuted global batch into per-rank slices, and with the exact loss path
the model scoring step t does not depend on that cut, so under health the ranks' per-sequence
losses are exchangeable within a step: no baseline, no burn-in. Per step t and rank r with n of
the step's N sequences, the Mann-Whitney U_rt has mean n (N - n) / 2 and variance
n (N - n) (N + 1) / 12 (ties only shrink it: conservative); over the last W measured steps the
Stouffer sum Z_r = \sum_t z_rt / sqrt(W) is about standard normal. The rule fires when
|Z_r| > z* = Phi^-1(1 - alpha / (2 m)), m the ranks tested (1 at dp = 2, where Z_0 = -Z_1): by the
union bound at most alpha false alarms per measured step. A rank whose every sequence scores
above all others' reaches z_max = sqrt(3 n (N - n) / (N + 1)) per step, so it can fire only if
z_max sqrt(W) > z* (reachable(); one sequence per rank at dp = 8 and W = 10 cannot)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from statistics import NormalDist

import numpy as np

from titanlite.config.job_config import Alerts as AlertsConfig
from titanlite.diagnostics.registry import Finding, Point


def rank_scores(samples: list[list[float]]) -> list[float | None]:
    """z_rt of each rank (module doc) from its sequences' token-mean losses; None for a rank
    with no scored sequence or when no other rank has one."""
    values = np.array([x for xs in samples for x in xs], dtype=np.float64)
    owner = np.repeat(np.arange(len(samples)), [len(xs) for xs in samples])
    total = len(values)
    # midranks: tied values share the mean of their (1-based) positions; half-integers, so exact
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    mid = (np.cumsum(counts) - (counts - 1) / 2)[inverse]
    rank_sums = np.bincount(owner, weights=mid, minlength=len(samples)).tolist()
    scores: list[float | None] = []
    for r, xs in enumerate(samples):
        n = len(xs)
        rest = total - n
        if n == 0 or rest == 0:
            scores.append(None)
            continue
        u = rank_sums[r] - n * (n + 1) / 2
        sd = math.sqrt(n * rest * (total + 1) / 12)
        scores.append((u - n * rest / 2) / sd)
    return scores


def threshold(alpha: float, world: int) -> float:
    """z*: |Z_r| above it raises the alert (module doc)."""
    tested = 1 if world == 2 else world
    return NormalDist().inv_cdf(1 - alpha / (2 * tested))


def window_score(scores: list[float | None]) -> float | None:
    """Z_r over a window: the Stouffer sum of one rank's z_rt (steps it had none are left out)."""
    seen = [z for z in scores if z is not None]
    return sum(seen) / math.sqrt(len(seen)) if seen else None


def max_step_score(per_rank: int, world: int) -> float:
    """z_max: a rank's z when all its `per_rank` sequences score above all others' (module doc)."""
    n, total = per_rank, per_rank * world
    return math.sqrt(3 * n * (total - n) / (total + 1))


def reachable(per_rank: int, world: int, window: int, alpha: float) -> bool:
    """Whether a rank whose sequences all score above the others' can raise the alert within
    `window` measured steps, at `per_rank` sequences per rank per step."""
    return max_step_score(per_rank, world) * math.sqrt(window) > threshold(alpha, world)


# At dp = 2 the rank whose loss moved is the one that left the global trend of the steps before
# the test window by at least this many times the other's departure.
DOMINANCE = 2.0
TREND_MIN_STEPS = 5  # points before the window needed to fit that trend
SETTLED_STEPS = 3  # the window's last points, whose median departure is compared


def rank_outlier(
    scores: list[tuple[int, list[float | None]]],
    history: list[Point],
    cfg: AlertsConfig,
    explained: Callable[[str | None, int | None], bool],
    named: set[int] | frozenset[int] = frozenset(),
) -> Finding | None:
    """single_rank_outlier from the per-sample rank test (module doc) over `scores`, (step, z_rt
    per rank) of the window; `history`, the points up to this step, tells at dp = 2 which rank
    moved; `named`: the ranks this alert has named so far in the run."""
    world = len(scores[-1][1])
    z_star = threshold(cfg.rank_test_alpha, world)
    totals = [window_score([s[r] for _, s in scores]) for r in range(world)]
    quiet = (lambda r: explained(None, None)) if world == 2 else (lambda r: explained(None, r))
    hits = [
        (abs(z), r)
        for r, z in enumerate(totals)
        if z is not None and abs(z) > z_star and not quiet(r)
    ]
    if not hits:
        return None
    rank = max(hits)[1]
    ranks = [rank]
    why = ""
    if world == 2:  # the test says the two differ; which one moved needs their history
        ranks, why = _which_of_two(history, scores[0][0])
        if len(ranks) == 2 and len(named) == 1:  # a fault that lasts: its history is the fault's
            ranks = sorted(named)
            why = f"rank {ranks[0]} is the one named when the ranks parted"
        rank = ranks[0] if len(ranks) == 1 else rank
    z = totals[rank]
    msg = (
        f"rank {rank}'s sequences had {'higher' if z > 0 else 'lower'} losses than the other ranks' of the same "
        f"steps over the last {len(scores)} measured steps (per-sample rank test z = {z:+.1f}, beyond "
        f"{z_star:.1f}: at most {cfg.rank_test_alpha:g} false alarms per measured step)"
    )
    msg += f"; {why}" if why else ""
    # at dp = 2 one test whichever rank it names: one cooldown
    key = -1 if world == 2 else None
    return Finding("single_rank_outlier", ranks, msg, {"z": z, "threshold": z_star}, key)


def _which_of_two(history: list[Point], first_step: int) -> tuple[list[int], str]:
    """At dp = 2 the test says that the two ranks differ, not which one is off: the rank whose
    loss left the trend of the global loss (a least-squares line over the points before the
    window) while the other's stayed on it; both when neither or both did."""
    base = [q for q in history if q.step < first_step and q.rank_loss]
    # the window's last points where both ranks scored tokens
    recent = [
        q for q in history if q.step >= first_step and q.rank_loss and None not in q.rank_loss
    ]
    recent = recent[-SETTLED_STEPS:]
    if len(base) < TREND_MIN_STEPS or not recent:
        why = f"only {len(base)} measured step(s) before the window to tell which rank moved from"
        return [0, 1], f"both named: with two ranks, {why}"
    xs = [q.step for q in base]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(q.loss for q in base)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((q.step - mean_x) * (q.loss - mean_y) for q in base) / var if var > 0 else 0.0
    off = [
        statistics.median(q.rank_loss[r] - (mean_y + slope * (q.step - mean_x)) for q in recent)
        for r in (0, 1)
    ]
    moved = max((0, 1), key=lambda r: abs(off[r]))
    left = f"against the global loss's trend before the window, rank 0 moved {off[0]:+.3f} and rank 1 {off[1]:+.3f}"
    if abs(off[moved]) >= DOMINANCE * abs(off[1 - moved]):
        return [moved], f"rank {moved} is the one that moved ({left})"
    return [0, 1], f"both named: with two ranks, {left}, so neither is clearly the one that moved"
