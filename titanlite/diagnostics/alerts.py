"""Named alerts from the anomaly tables of the Loss Dispersion and the Gradient Direction
Consistency Reference Manuals (titanlite's source documents), which describe the metrics of
"Silent Inconsistency in Data-Parallel Full Fine-Tuning" (arXiv 2602.14462).

A pure function of the sequence of measured-step records (stats.step_metrics), so it gives the
same verdict on every rank and can be replayed on a recorded diagnostics.jsonl. Every threshold
is a [diagnostics] field. An alert fires at most once per `alert_window` measured steps per
(name, rank). The first `alert_min_steps` measured steps are a burn-in that does not even count
as a baseline: early training is not representative (dispersion rises from ~0 as the model
learns anything; gradients agree strongly at first, then stop), and rules need that much history.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import asdict, dataclass, field

from titanlite.config.job_config import Diagnostics as DiagnosticsConfig
from titanlite.datasets.corpus import source_name
from titanlite.diagnostics.data_checks import DataChecks

CAUSES = {
    "dispersion_spike": "seed mismatch (dropout/augmentation) or shuffle desync: align the seeds, check the sampler's epoch",
    "dispersion_rising_loss_falling": "ranks drifting apart while the average looks healthy: audit seeds, sharding and precision now",
    "single_rank_outlier": "a bad batch on that rank (corrupted, extreme or noisy samples): inspect its data",
    "identical_data": "ranks read the same data (rank not passed to the loader?): audit the sharding",
    "stale_batch": "that rank's data loader repeats a batch (a reader stuck on a stale buffer or cache): "
    "check its loader workers and storage, then resume from a checkpoint before the repeats",
    "data_order_mismatch": "the ranks shuffle the data with different seeds or epochs (per-rank sampler seeds), so "
    "some sequences are read twice and others never: give every rank's sampler the same seed",
    "cosine_drop": "desynchronised seeds or data loader across ranks",
    "faulty_worker": "a faulty worker: possible silent data corruption or a failing device on that host",
    "spike_skipped": "a loss or gradient-norm spike: a bad batch (inspect the step's samples) or a learning rate too high",
    "replica_drift": "silent data corruption or a failing device on that host (check its ECC errors: nvidia-smi -q -d ECC), "
    "or an op that is not deterministic across replicas; resume from the last checkpoint without that host",
}


@dataclass
class Alert:
    name: str
    step: int
    ranks: list[int]
    hosts: list[str]
    message: str
    cause: str = ""
    values: dict = field(default_factory=dict)
    # The sequences the named ranks trained on at `step`: rank, index, tokens, loss, sources.
    samples: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cause = self.cause or CAUSES[self.name]

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        where = f" rank(s) {self.ranks} on {sorted(set(self.hosts))}" if self.ranks else ""
        line = f"ALERT {self.name} at step {self.step}{where}: {self.message}; likely cause: {self.cause}"
        if not self.samples:
            return line
        worst = sorted(self.samples, key=lambda s: -(s["loss"] if s.get("loss") is not None else -1.0))
        shown = ", ".join(_sample(s) for s in worst[:SHOWN_SAMPLES])
        more = len(self.samples) - SHOWN_SAMPLES
        rest = f"; {more} more in events.jsonl" if more > 0 else ""
        label = "highest-loss samples" if any(s.get("loss") is not None for s in worst) else "samples"
        return f"{line}; {label}: {shown}{rest} (scripts/inspect_step.py shows them)"


SHOWN_SAMPLES = 3  # samples an alert's console line names (events.jsonl keeps them all)


def _sample(s: dict) -> str:
    """`r2 #1100 stdlib:inspect row 0 (441 tok, loss 7.91)`: rank, dataset index, first source."""
    src = s["sources"][0] if s["sources"] else None
    where = f" {source_name(src['file'])} row {src['row']}" if src else ""
    extra = f" +{len(s['sources']) - 1} doc(s)" if len(s["sources"]) > 1 else ""
    facts = [f"{s['tokens']} tok"] if s.get("tokens") is not None else []
    facts += [f"loss {s['loss']:.3f}"] if s.get("loss") is not None else []
    return f"r{s['rank']} #{s['index']}{where}{extra}" + (f" ({', '.join(facts)})" if facts else "")


@dataclass
class _Point:
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


def _median_excluding(values: list, r: int) -> float:
    return statistics.median(v for j, v in enumerate(values) if j != r and v is not None)


def _point(rec: dict) -> _Point | None:
    losses, tokens = rec["rank_loss"], rec["rank_tokens"]
    live = [r for r, v in enumerate(losses) if v is not None]
    if not live:
        return None
    total = sum(tokens[r] for r in live)
    loss = sum(losses[r] * tokens[r] for r in live) / total
    # "One rank drives the range" needs 3+ ranks: of two, one is always the higher (and is so
    # in 14 of 20 steps by chance about 6% of the time).
    max_rank = max(live, key=losses.__getitem__) if len(live) >= 3 else None
    others = [losses[r] for r in live if r != max_rank]
    gap = (losses[max_rank] - statistics.fmean(others)) / loss if max_rank is not None and loss > 0 else 0.0
    low_rank, low_margin, big_rank, big_ratio = None, 0.0, None, 0.0
    cos = rec.get("cos_matrix")
    if cos and len(live) >= 3:
        # A rank's median cosine to the others: one dominant rank cannot drag everyone's down.
        med = {
            r: statistics.median(cos[r][j] for j in live if j != r and cos[r][j] is not None) for r in live
        }
        low_rank = min(med, key=med.get)
        low_margin = statistics.median(v for r, v in med.items() if r != low_rank) - med[low_rank]
    norms = rec.get("rank_grad_norm")
    if norms and len(live) >= 3:
        big_rank = max(live, key=norms.__getitem__)
        rest = _median_excluding(norms, big_rank)
        big_ratio = norms[big_rank] / rest if rest > 0 else 0.0
    return _Point(
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


def _persistent(
    pts: list[_Point], rank_attr: str, value_attr: str, world: int, frac: float
) -> tuple[int, int, float] | None:
    """The rank named by `rank_attr` most often in the window, if in at least `frac` of it:
    (rank, how often, mean of `value_attr` over those steps)."""
    counts = [sum(getattr(q, rank_attr) == r for q in pts) for r in range(world)]
    top = max(range(world), key=counts.__getitem__)
    if counts[top] < frac * len(pts):
        return None
    return (
        top,
        counts[top],
        statistics.fmean(getattr(q, value_attr) for q in pts if getattr(q, rank_attr) == top),
    )


class AlertMonitor:
    def __init__(self, cfg: DiagnosticsConfig, hosts: list[str]) -> None:
        self.cfg = cfg
        self.hosts = hosts
        self.history: deque[_Point] = deque(maxlen=cfg.alert_window)
        self.trend: deque[tuple[float, float]] = deque(maxlen=cfg.trend_window)  # (loss, loss_std)
        self.seen = 0
        self._last: dict[tuple[str, int], int] = {}
        # (data check, rank) -> measured step it last failed: what explains a rank's statistics
        self._data_failed: dict[tuple[str, int], int] = {}
        self.data = DataChecks()

    def state_dict(self) -> dict:
        return {
            "history": [asdict(p) for p in self.history],
            "trend": [list(t) for t in self.trend],
            "seen": self.seen,
            "last": [[name, rank, seen] for (name, rank), seen in self._last.items()],
            "data": self.data.state_dict(),
            "data_failed": [[name, rank, seen] for (name, rank), seen in self._data_failed.items()],
        }

    def load_state_dict(self, state: dict) -> None:
        self.history = deque((_Point(**p) for p in state["history"]), maxlen=self.cfg.alert_window)
        self.trend = deque((tuple(t) for t in state.get("trend", [])), maxlen=self.cfg.trend_window)
        self.seen = state["seen"]
        self._last = {(name, rank): seen for name, rank, seen in state["last"]}
        self.data.load_state_dict(state.get("data", {}))
        self._data_failed = {(name, rank): seen for name, rank, seen in state.get("data_failed", [])}

    def _explained(self, name: str | None = None, rank: int | None = None) -> bool:
        """Whether a data check (`name`, any if None) failed for `rank` (any if None) within the
        window: it names the cause, so statistical rules about the same ranks stay quiet."""
        return any(
            (name is None or n == name)
            and (rank is None or r == rank)
            and self.seen - seen < self.cfg.alert_window
            for (n, r), seen in self._data_failed.items()
        )

    def _fire(self, name: str, p: _Point, ranks: list[int], message: str, **values) -> list[Alert]:
        key = (name, ranks[0] if ranks else -1)
        if self.seen - self._last.get(key, -(10**9)) < self.cfg.alert_window:
            return []
        self._last[key] = self.seen
        return [Alert(name, p.step, ranks, [self.hosts[r] for r in ranks], message, values=values)]

    def update(self, rec: dict) -> list[Alert]:
        p = _point(rec)
        if p is None:
            return []
        c = self.cfg
        self.seen += 1
        # Exact checks of what the ranks read: no history needed, so no burn-in.
        out = []
        for name, ranks, msg in self.data.update(rec):
            out += self._fire(name, p, ranks, msg)
            self._data_failed.update({(name, r): self.seen for r in ranks})
        if self.seen <= c.alert_min_steps:
            return out  # burn-in: not even a baseline
        past = list(self.history)
        self.history.append(p)
        pts = list(self.history)
        if len(past) < c.alert_min_steps:
            return out
        world = len(self.hosts)
        # 1. a dispersion spike while the global loss stays smooth
        ref_std = statistics.median(q.loss_std for q in past)
        ref_loss = statistics.median(q.loss for q in past[-5:])
        # Dispersion rules need 3+ ranks: with two, the std is one heavy-tailed pairwise difference.
        spread_ok = p.ranks >= 3
        if (
            spread_ok
            and ref_std > 0
            and p.loss_std > c.spike_factor * ref_std
            and abs(p.loss - ref_loss) < c.smooth_loss_tol * ref_loss
        ):
            msg = f"loss dispersion {p.loss_std:.4f} is {p.loss_std / ref_std:.1f}x its recent median while the global loss is smooth"
            out += self._fire("dispersion_spike", p, [], msg, loss_std=p.loss_std, median=ref_std)
        # 2. dispersion rising while the global loss falls (the Loss Dispersion manual's critical warning)
        # Dispersion grows naturally for a long time while the model learns: own, longer burn-in.
        # A drift is a long trend, and the std over a few ranks is noisy from step to step (a
        # healthy dp=4 run: 0.13 to 1.3 around a median of 0.47): medians of thirds of a long
        # window. Means of thirds of 20 steps doubled twice in a healthy 1,000-step run.
        self.trend.append((p.loss, p.loss_std))
        if spread_ok and self.seen > c.trend_burn_in and len(self.trend) == c.trend_window:
            third = max(1, c.trend_window // 3)
            first, last = list(self.trend)[:third], list(self.trend)[-third:]
            std_a, std_b = (statistics.median(s for _, s in part) for part in (first, last))
            loss_a, loss_b = (statistics.median(loss for loss, _ in part) for part in (first, last))
            if std_a > 0 and std_b > (1 + c.trend_rise) * std_a and loss_b < loss_a:
                msg = f"loss dispersion rose {std_a:.4f} -> {std_b:.4f} while the global loss fell {loss_a:.4f} -> {loss_b:.4f}"
                out += self._fire("dispersion_rising_loss_falling", p, [], msg, std_from=std_a, std_to=std_b)
        # 3. one rank drives the range, persistently
        hit = _persistent(pts, "max_rank", "gap", world, c.persist_frac)
        if hit and hit[2] > c.outlier_margin and not self._explained(rank=hit[0]):
            top, n, gap = hit
            msg = f"rank {top} had the highest loss in {n} of the last {len(pts)} measured steps, {100 * gap:.1f}% above the others"
            out += self._fire("single_rank_outlier", p, [top], msg, share=n / len(pts))
        # 4. ranks indistinguishable throughout: the same data (unless the exact check, which
        # names the ranks, already says so)
        recent = pts[-c.alert_min_steps :]
        if not self._explained("identical_data") and all(
            q.loss_std <= c.identical_std * q.loss or (q.cos is not None and q.cos > c.identical_cos)
            for q in recent
        ):
            msg = (
                f"loss dispersion ~0 or gradient cosine > {c.identical_cos} for {len(recent)} measured steps"
            )
            out += self._fire("identical_data", p, [], msg, loss_std=p.loss_std, cos=p.cos)
        # 5. alignment collapsing: typically above cos_high, now near 0 or below
        cos_past = [q.cos for q in past if q.cos is not None]
        if cos_past and statistics.median(cos_past) > c.cos_high and p.cos is not None and p.cos < c.cos_low:
            msg = f"mean pairwise gradient cosine fell to {p.cos:.3f} from a median of {statistics.median(cos_past):.3f}"
            out += self._fire("cosine_drop", p, [], msg, cos=p.cos)
        # 6. one rank persistently disagrees with the others, or its gradient norm stands apart
        hit = _persistent(pts, "low_rank", "low_margin", world, c.persist_frac)
        if hit and hit[2] > c.faulty_margin and not self._explained(rank=hit[0]):
            low, n, margin = hit
            msg = (
                f"rank {low} ({self.hosts[low]}) had the lowest gradient cosine to the other ranks in {n} of the "
                f"last {len(pts)} measured steps, {margin:.3f} below their median"
            )
            out += self._fire("faulty_worker", p, [low], msg, share=n / len(pts))
        hit = _persistent(pts, "big_rank", "big_ratio", world, c.persist_frac)
        if hit and hit[2] > c.norm_outlier_factor and not self._explained(rank=hit[0]):
            big, n, ratio = hit
            msg = (
                f"rank {big} ({self.hosts[big]}) had the largest gradient norm in {n} of the last {len(pts)} "
                f"measured steps, {ratio:.1f}x the others' median"
            )
            out += self._fire("faulty_worker", p, [big], msg, share=n / len(pts))
        return out
