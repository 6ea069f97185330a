"""The statistical rules behind the named alerts: one small function per rule and the table
the monitor (titanlite.diagnostics.alerts) runs in order.

A rule reads a `Window` (the measured step reduced to a `Point`, the points before it, the
thresholds of the [alerts] section) and returns a `Finding` or None; the monitor adds the
cooldown, the hosts and the cause. A new rule is a function and one entry in RULES, its
thresholds fields of titanlite.config.job_config.Alerts.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from titanlite.config.job_config import Alerts as AlertsConfig


@dataclass
class Point:
    """One measured step, reduced to what the rules compare."""

    step: int
    loss: float  # global token mean
    loss_std: float
    ranks: int  # live ranks (with valid tokens)
    cos: float | None
    max_rank: int | None
    gap: float  # (max rank loss - mean of the others) / global loss
    low_rank: int | None  # lowest median cosine to the other ranks
    low_margin: float  # median of the others' median cosines minus the lowest one
    big_rank: int | None  # largest own gradient norm
    big_ratio: float  # its norm / median of the others' norms


# The rules that single a rank out, or judge the loss spread, need 3+ live ranks: of two, one is
# always the higher, and the std is one heavy-tailed pairwise difference.
SPREAD_RANKS = 3
NEED_SPREAD = ("single_rank_outlier", "faulty_worker", "dispersion_spike", "dispersion_rising_loss_falling")


def silent_rules_note(world: int) -> str | None:
    """What a start-up note says when the data-parallel world is too small for some rules."""
    if world < 2 or world >= SPREAD_RANKS:
        return None
    return (
        f"at dp={world} the alerts {', '.join(NEED_SPREAD)} need {SPREAD_RANKS} or more ranks and stay "
        "silent: a rank with bad labels or a noisy gradient is not named (identical_data, cosine_drop "
        "and replica_drift still run)"
    )


def _median_excluding(values: list, r: int) -> float:
    return statistics.median(v for j, v in enumerate(values) if j != r and v is not None)


def point(rec: dict) -> Point | None:
    """A measured-step record (stats.step_metrics) as a Point; None if no rank had tokens."""
    losses, tokens = rec["rank_loss"], rec["rank_tokens"]
    live = [r for r, v in enumerate(losses) if v is not None]
    if not live:
        return None
    total = sum(tokens[r] for r in live)
    loss = sum(losses[r] * tokens[r] for r in live) / total
    # "One rank drives the range" needs 3+ ranks: of two, one is always the higher (and is so
    # in 14 of 20 steps by chance about 6% of the time).
    max_rank = max(live, key=losses.__getitem__) if len(live) >= SPREAD_RANKS else None
    others = [losses[r] for r in live if r != max_rank]
    gap = (losses[max_rank] - statistics.fmean(others)) / loss if max_rank is not None and loss > 0 else 0.0
    low_rank, low_margin, big_rank, big_ratio = None, 0.0, None, 0.0
    cos = rec.get("cos_matrix")
    if cos and len(live) >= SPREAD_RANKS:
        # A rank's median cosine to the others: one dominant rank cannot drag everyone's down.
        med = {
            r: statistics.median(cos[r][j] for j in live if j != r and cos[r][j] is not None) for r in live
        }
        low_rank = min(med, key=med.get)
        low_margin = statistics.median(v for r, v in med.items() if r != low_rank) - med[low_rank]
    norms = rec.get("rank_grad_norm")
    if norms and len(live) >= SPREAD_RANKS:
        big_rank = max(live, key=norms.__getitem__)
        rest = _median_excluding(norms, big_rank)
        big_ratio = norms[big_rank] / rest if rest > 0 else 0.0
    return Point(
        rec["step"],
        loss,
        rec.get("loss_std", 0.0),
        len(live),
        rec.get("cos_mean_pairwise"),
        max_rank,
        gap,
        low_rank,
        low_margin,
        big_rank,
        big_ratio,
    )


@dataclass
class Finding:
    name: str  # a key of alerts.CAUSES
    ranks: list[int]  # the ranks it names; [] for the whole job
    message: str
    values: dict = field(default_factory=dict)


@dataclass
class Window:
    """What a rule may read at one measured step."""

    cfg: AlertsConfig
    p: Point  # this step
    past: list[Point]  # the alert window before it
    trend: list[tuple[float, float]]  # (loss, loss_std) of the last trend_window steps, this one included
    seen: int  # measured steps so far, this one included
    world: int
    # Whether a data check failed for (check name or any, rank or any) within the window: it
    # names the cause, so statistical rules about the same ranks stay quiet.
    explained: Callable[[str | None, int | None], bool]

    @property
    def pts(self) -> list[Point]:
        return [*self.past, self.p][-self.cfg.window :]

    def persistent(self, rank_attr: str, value_attr: str) -> tuple[int, int, float] | None:
        """The rank named by `rank_attr` most often in the window, if in at least persist_frac of
        it and not explained by a data check: (rank, how often, mean `value_attr` over those steps)."""
        pts = self.pts
        counts = [sum(getattr(q, rank_attr) == r for q in pts) for r in range(self.world)]
        top = max(range(self.world), key=counts.__getitem__)
        if counts[top] < self.cfg.persist_frac * len(pts) or self.explained(None, top):
            return None
        mean = statistics.fmean(getattr(q, value_attr) for q in pts if getattr(q, rank_attr) == top)
        return top, counts[top], mean


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
    the std over a few ranks is noisy from step to step (a healthy dp=4 run: 0.13 to 1.3 around
    a median of 0.47), so it compares medians of thirds of a long window (means of thirds of 20
    steps doubled twice in a healthy 1,000-step run)."""
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


RULES: tuple[Callable[[Window], Finding | None], ...] = (
    dispersion_spike,
    dispersion_rising_loss_falling,
    single_rank_outlier,
    identical_data,
    cosine_drop,
    faulty_worker_direction,
    faulty_worker_norm,
)
