"""Named alerts from the anomaly tables of the Loss Dispersion and the Gradient Direction
Consistency Reference Manuals (titanlite's source documents), which describe the metrics of
"Silent Inconsistency in Data-Parallel Full Fine-Tuning" (arXiv 2602.14462).

A pure function of the sequence of measured-step records (stats.step_metrics), so it gives the
same verdict on every rank and can be replayed on a recorded diagnostics.jsonl. Every threshold
is an [alerts] field. An alert fires at most once per `window` measured steps per
(name, rank). The first `min_steps` measured steps are a burn-in that does not even count
as a baseline: early training is not representative (dispersion rises from ~0 as the model
learns anything; gradients agree strongly at first, then stop), and rules need that much history.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field

from titanlite.config.job_config import Alerts as AlertsConfig
from titanlite.datasets.corpus import source_name
from titanlite.diagnostics.advisor import BatchAdvisor
from titanlite.diagnostics.data_checks import DataChecks
from titanlite.diagnostics.rank_test import rank_outlier, rank_scores
from titanlite.diagnostics.rules import RULES
from titanlite.diagnostics.stragglers import slow_rank
from titanlite.diagnostics.window import Point, Window, point

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
    "slow_rank": "a straggler, which the whole job waits for: if its data loading takes the extra time, its loader "
    "or storage; otherwise its host or device (a busy neighbour process, throttling: nvidia-smi -q -d PERFORMANCE)",
    "batch_size_advice": "information, not an alert: the run is healthy",
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
    level: str = "alert"  # or "info": a note (batch_size_advice) that neither counts nor stops a run

    def __post_init__(self) -> None:
        self.cause = self.cause or CAUSES[self.name]

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def is_alert(self) -> bool:
        return self.level == "alert"

    def line(self) -> str:
        if not self.is_alert:
            return f"NOTE {self.name} at step {self.step}: {self.message}"
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


class AlertMonitor:
    """`batch_unit`: sequences the global batch moves by with the layout kept (dp x local batch),
    for the batch-size advice's flag."""

    def __init__(self, cfg: AlertsConfig, hosts: list[str], batch_unit: int = 0) -> None:
        self.cfg = cfg
        self.hosts = hosts
        # (step, per-rank z) of the per-sample rank test's window: from the first measured step,
        # since its null needs no baseline (rank_test.py)
        self.scores: deque[tuple[int, list]] = deque(maxlen=cfg.rank_test_window)
        self.recent: deque[Point] = deque(maxlen=cfg.slow_window)  # slow_rank's, also from the first
        self.named: dict[str, set[int]] = {}  # alert -> the ranks it has named in this run
        self.advisor = BatchAdvisor(cfg, batch_unit or len(hosts))
        self.history: deque[Point] = deque(maxlen=cfg.window)
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
            "scores": [[step, z] for step, z in self.scores],
            "recent": [asdict(p) for p in self.recent],
            "named": {name: sorted(ranks) for name, ranks in self.named.items()},
            "advisor": self.advisor.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        # A run resumed at another dp keeps the rules' history but not its per-rank vectors,
        # which stand for other ranks.
        world = len(self.hosts)
        points = [Point(**p) for p in state["history"]]
        for p in points:
            if p.rank_loss is not None and len(p.rank_loss) != world:
                p.rank_loss = p.rank_norm = p.rank_noise = p.rank_wait = p.rank_load = None
        self.history = deque(points, maxlen=self.cfg.window)
        self.trend = deque((tuple(t) for t in state.get("trend", [])), maxlen=self.cfg.trend_window)
        self.seen = state["seen"]
        self._last = {(name, rank): seen for name, rank, seen in state["last"]}
        self.data.load_state_dict(state.get("data", {}))
        self._data_failed = {(name, rank): seen for name, rank, seen in state.get("data_failed", [])}
        self.scores.extend((step, z) for step, z in state.get("scores", []) if len(z) == world)
        recent = (Point(**p) for p in state.get("recent", []))
        self.recent.extend(p for p in recent if p.rank_wait is not None and len(p.rank_wait) == world)
        self.named = {name: set(ranks) for name, ranks in state.get("named", {}).items()}
        self.advisor.load_state_dict(state.get("advisor", {}))

    def _explained(self, name: str | None, rank: int | None) -> bool:
        """Whether a data check (`name`, any if None) failed for `rank` (any if None) within the
        window: it names the cause, so statistical rules about the same ranks stay quiet."""
        return any(
            (name is None or n == name) and (rank is None or r == rank) and self.seen - seen < self.cfg.window
            for (n, r), seen in self._data_failed.items()
        )

    def _fire(
        self, name: str, p: Point, ranks: list[int], message: str, key: int | None = None, **values
    ) -> list[Alert]:
        key = (name, key if key is not None else ranks[0] if ranks else -1)
        if self.seen - self._last.get(key, -(10**9)) < self.cfg.window:
            return []
        self._last[key] = self.seen
        self.named.setdefault(name, set()).update(ranks)
        return [Alert(name, p.step, ranks, [self.hosts[r] for r in ranks], message, values=values)]

    def update(self, rec: dict) -> list[Alert]:
        """The alerts this measured-step record raises: the exact data checks, the per-sample rank
        test and the straggler rule, the batch-size advice, then, after the burn-in, every rule of
        the table (titanlite.diagnostics.rules.RULES) in order."""
        p = point(rec)
        if p is None:
            return []
        c = self.cfg
        self.seen += 1
        # Exact checks of what the ranks read, a test whose null holds at every step, and timing:
        # no training history needed, so no burn-in.
        out = []
        for name, ranks, msg in self.data.update(rec):
            out += self._fire(name, p, ranks, msg)
            self._data_failed.update({(name, r): self.seen for r in ranks})
        if rec.get("rank_samples") and len(self.hosts) > 1:
            losses = [[s["loss"] for s in rank if s.get("loss") is not None] for rank in rec["rank_samples"]]
            self.scores.append((p.step, rank_scores(losses)))
            named = self.named.get("single_rank_outlier", set())
            found = rank_outlier(list(self.scores), [*self.history, p], c, self._explained, named)
            if found:
                out += self._fire(found.name, p, found.ranks, found.message, found.key, **found.values)
        self.recent.append(p)
        late = slow_rank(list(self.recent), c, self._explained) if len(self.hosts) > 1 else None
        if late:
            out += self._fire(late.name, p, late.ranks, late.message, **late.values)
        advice = self.advisor.update(rec)
        if advice:
            out.append(Alert(advice.name, p.step, [], [], advice.message, values=advice.values, level="info"))
        if self.seen <= c.min_steps:
            return out  # burn-in: not even a baseline
        past = list(self.history)
        self.history.append(p)
        if len(past) < c.min_steps:
            return out
        self.trend.append((p.loss, p.loss_std))
        window = Window(c, p, past, list(self.trend), self.seen, len(self.hosts), self._explained, self.named)
        for rule in RULES:
            found = rule(window)
            if found:
                out += self._fire(found.name, p, found.ranks, found.message, found.key, **found.values)
        return out
