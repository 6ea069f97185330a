"""What an alert is and what it reads. Every alert is one `AlertSpec` (name, cause, level, source,
checks, thresholds, own state); one runner (alerts.AlertMonitor) serves them all. A check reads a
`Context`; the statistical rules read its `Window` (the step as a `Point` and the points before).
A fork adds an alert with `register(AlertSpec(...))` in a module the run imports first
(`model.import_module`); the built-in ones are registered by catalogue.py, in check order."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from titanlite.config.job_config import Alerts as AlertsConfig
from titanlite.diagnostics.stats import cos_medians, rank_noise
from titanlite.errors import UserError

# an alert counts and may stop a run (diagnostics.on_alert); info is a note
LEVELS = ("alert", "info")
# What a check reads: a measured step's record (diagnostics.jsonl), the spike guard's verdict of a
# skipped step, or a comparison of the replicas' parameters.
SOURCES = ("measured", "spikes", "replicas")
_FIELDS = frozenset(f.name for f in fields(AlertsConfig))


# The rules that single a rank out by comparing it with the others at one step, or judge the
# loss spread, need 3+ live ranks: of two, one is always the higher, and the std is one
# heavy-tailed pairwise difference. Rules against a rank's own history work at 2.
SPREAD_RANKS = 3


@dataclass
class Point:
    """One measured step, reduced to what the rules compare."""

    step: int
    loss: float  # global token mean
    loss_std: float
    ranks: int  # live ranks (with valid tokens)
    cos: float | None
    # The rank that stands out (None below SPREAD_RANKS live ranks) and by how much:
    max_rank: int | None = None
    gap: float = 0.0  # (max rank loss - mean of the others) / global loss
    low_rank: int | None = None  # lowest median cosine to the other ranks
    low_margin: float = 0.0  # median of the others' median cosines minus the lowest one
    big_rank: int | None = None  # largest own gradient norm
    big_ratio: float = 0.0  # its norm / median of the others' norms
    # Per rank (None where a rank had no valid token, or a run recorded before they were kept):
    rank_loss: list | None = None  # token-mean loss
    rank_norm: list | None = None  # norm of its own token-mean gradient
    rank_noise: list | None = None  # its gradient noise per token (stats.rank_noise)
    rank_wait: list | None = None  # seconds waited at the step's start barrier (stragglers.py)
    rank_load: list | None = None  # seconds its data loading took
    step_s: float | None = None  # the ranks' median step time (host clock), seconds


def point(rec: dict) -> Point | None:
    """A measured-step record (stats.step_metrics) as a Point; None if no rank had tokens."""
    losses, tokens = rec["rank_loss"], rec["rank_tokens"]
    live = [r for r, v in enumerate(losses) if v is not None]
    if not live:
        return None
    total = sum(tokens[r] for r in live)
    norms, cos = rec.get("rank_grad_norm"), rec.get("cos_matrix")
    noise = rec.get("rank_noise")
    if noise is None and norms and cos:  # a record of version 1 has no summaries of its own
        noise = rank_noise(norms, tokens, cos)
    p = Point(
        rec["step"],
        sum(losses[r] * tokens[r] for r in live) / total,
        rec.get("loss_std", 0.0),
        len(live),
        rec.get("cos_mean_pairwise"),
        rank_loss=list(losses),
        rank_norm=list(norms) if norms else None,
        rank_noise=noise,
        rank_wait=rec.get("rank_wait_s"),
        rank_load=rec.get("rank_load_s"),
        step_s=rec.get("step_s"),
    )
    # "One rank drives the range" needs 3+ ranks: of two, one is always the higher (and is so
    # in 14 of 20 steps by chance about 6% of the time).
    if len(live) < SPREAD_RANKS:
        return p
    top = max(live, key=losses.__getitem__)
    p.max_rank = top
    if p.loss > 0:
        p.gap = (losses[top] - statistics.fmean(losses[r] for r in live if r != top)) / p.loss
    medians = rec.get("rank_cos_median") or (cos_medians(cos, live) if cos else None)
    if medians:
        # A rank's median cosine to the others: one dominant rank cannot drag everyone's down.
        med = {r: medians[r] for r in live if medians[r] is not None}
        low = min(med, key=med.get)
        p.low_rank = low
        p.low_margin = statistics.median(v for r, v in med.items() if r != low) - med[low]
    if norms:
        big = max(live, key=norms.__getitem__)
        p.big_rank = big
        rest = statistics.median(v for j, v in enumerate(norms) if j != big and v is not None)
        p.big_ratio = norms[big] / rest if rest > 0 else 0.0
    return p


@dataclass
class Finding:
    name: str  # a registered alert's
    ranks: list[int]  # the ranks it names; [] for the whole job
    message: str
    values: dict = field(default_factory=dict)
    key: int | None = None  # the cooldown's rank key when not the first rank named (-1: the job)


@dataclass
class Window:
    """What a rule may read at one measured step."""

    cfg: AlertsConfig
    p: Point  # this step
    past: list[Point]  # the alert window before it
    trend: list[tuple[float, float]]  # (loss, loss_std) of the last trend_window steps, this one's
    seen: int  # measured steps so far, this one included
    world: int
    explained: Callable[[str | None, int | None], bool]  # as Context's
    named: dict[str, set[int]] = field(default_factory=dict)  # as Context's

    @property
    def pts(self) -> list[Point]:
        return [*self.past, self.p][-self.cfg.window :]

    def persistent(
        self, rank_attr: str, value_attr: str, above: float
    ) -> tuple[int, int, float] | None:
        """The rank named by `rank_attr` most often in the window, if in at least persist_frac of
        it, not explained by a data check and its mean `value_attr` there above `above`: (rank,
        how often, that mean)."""
        pts = self.pts
        counts = [sum(getattr(q, rank_attr) == r for q in pts) for r in range(self.world)]
        top = max(range(self.world), key=counts.__getitem__)
        if counts[top] < self.cfg.persist_frac * len(pts) or self.explained(None, top):
            return None
        mean = statistics.fmean(getattr(q, value_attr) for q in pts if getattr(q, rank_attr) == top)
        return (top, counts[top], mean) if mean > above else None


class AlertState(Protocol):
    """An alert's own state: host values that a checkpoint saves and a resume restores."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class Context:
    """What a check reads at one observation."""

    spec: AlertSpec
    cfg: AlertsConfig
    step: int
    world: int
    seen: int  # measured steps so far, this one included
    state: Any  # the spec's own state (None without a `state` factory)
    # Whether a data check (name, or any) failed for a rank (or any) within the window: it names
    # the cause, so statistical checks about the same ranks stay quiet.
    explained: Callable[[str | None, int | None], bool]
    named: dict[str, set[int]]  # the ranks each alert has named so far in the run
    unit: int = 1  # the sequences the global batch moves by with the layout kept (dp x local)
    record: dict | None = None  # source "measured": the step's record
    point: Point | None = None  # ... reduced to what the rules compare
    history: list[Point] = field(default_factory=list)  # the rules' history before this step
    window: Window | None = None  # past the burn-in: what the statistical rules read
    event: dict | None = None  # sources "spikes" and "replicas": what they report

    def threshold(self, name: str) -> float:
        """An [alerts] field, or a default the spec carries (a fork's alert)."""
        return getattr(self.cfg, name) if name in _FIELDS else self.spec.defaults[name]


@dataclass(frozen=True)
class Check:
    """One way an alert is found: `fn(ctx)` returns a Finding, several or None. `burn_in`: run
    only past the burn-in (alerts.min_steps measured steps of history), with ctx.window set."""

    fn: Callable[[Context], Finding | list[Finding] | None]
    burn_in: bool = False
    # The measured steps a run needs before it can first fire, from the [alerts] config; None:
    # the first (no burn_in) or the burn-in then as much history (2 x min_steps + 1).
    needs: Callable[[AlertsConfig], int] | None = None

    def first_judged(self, cfg: AlertsConfig) -> int:
        """The measured step (1-based) from which this check can fire."""
        if self.needs is not None:
            return self.needs(cfg)
        return 2 * cfg.min_steps + 1 if self.burn_in else 1


@dataclass(frozen=True)
class AlertSpec:
    name: str
    cause: str  # the likely cause and what to do, printed with every alert
    checks: tuple[Check, ...]
    level: str = "alert"
    source: str = "measured"
    thresholds: tuple[str, ...] = ()  # the [alerts] fields its checks read
    defaults: Mapping[str, float] = field(default_factory=dict)  # its own (no [alerts] field)
    # Its own state: made from (the [alerts] config, the world size, the batch unit); saved in checkpoints.
    state: Callable[[AlertsConfig, int, int], AlertState] | None = None
    cooldown: bool = True  # at most once per alerts.window measured steps per (alert, rank)
    explains: bool = False  # a data check: the ranks it names explain other alerts about them


REGISTRY: dict[str, AlertSpec] = {}


def register(spec: AlertSpec) -> AlertSpec:
    """Add an alert (checked here, not at run time); again under its name replaces it."""
    problems = []
    if not spec.name.isidentifier():
        problems.append(f"its name {spec.name!r} is not an identifier")
    if not spec.cause.strip():
        problems.append("it has no cause text")
    if spec.level not in LEVELS:
        problems.append(f"level {spec.level!r} is not one of {LEVELS}")
    if spec.source not in SOURCES:
        problems.append(f"source {spec.source!r} is not one of {SOURCES}")
    if not spec.checks:
        problems.append("it has no check")
    unknown = [t for t in spec.thresholds if t not in _FIELDS]
    if unknown:
        problems.append(f"thresholds {unknown} are not [alerts] fields (give them in `defaults`)")
    shadowed = [t for t in spec.defaults if t in _FIELDS]
    if shadowed:
        problems.append(f"defaults {shadowed} are [alerts] fields (name them in `thresholds`)")
    if problems:
        raise UserError(f"alert {spec.name!r} cannot be registered: {'; '.join(problems)}")
    REGISTRY[spec.name] = spec
    return spec


def cause(name: str) -> str:
    """The cause text of a registered alert ("" for another record, such as a data_changed note)."""
    spec = REGISTRY.get(name)
    return spec.cause if spec is not None else ""
