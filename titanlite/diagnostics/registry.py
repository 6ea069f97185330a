"""Every alert is one `AlertSpec`: its name, the cause it points to, its level, what it reads,
its checks (each from the first measured step or after the burn-in), its thresholds and its own
state. One runner (titanlite.diagnostics.alerts.AlertMonitor) serves them all: cooldown, hosts,
the ranks each alert has named, the burn-in, and one state_dict that a checkpoint carries.

Adding an alert is one record plus its thresholds:

    from titanlite.diagnostics.registry import AlertSpec, Check, register
    from titanlite.diagnostics.window import Finding

    def loss_above(ctx):  # a Context: the measured step's Point, the thresholds, this alert's state
        if ctx.point.loss > ctx.threshold("loss_limit"):
            return Finding("loss_above", [], f"loss {ctx.point.loss:.3f} above the limit")

    register(AlertSpec("loss_above", cause="...", checks=(Check(loss_above),), defaults={"loss_limit": 9.0}))

in a module the run imports first (`model.import_module`, as a fork's model registers). The
built-in alerts are registered by titanlite.diagnostics.catalogue, in the order they are checked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from titanlite.config.job_config import Alerts as AlertsConfig
from titanlite.diagnostics.window import Finding, Point, Window
from titanlite.errors import UserError

LEVELS = ("alert", "info")  # an alert counts and may stop a run (diagnostics.on_alert); info is a note
# What a check reads: a measured step's record (diagnostics.jsonl), the spike guard's verdict of a
# skipped step, or a comparison of the replicas' parameters.
SOURCES = ("measured", "spikes", "replicas")
_FIELDS = frozenset(f.name for f in fields(AlertsConfig))


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
    defaults: Mapping[str, float] = field(default_factory=dict)  # thresholds of its own (no [alerts] field)
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
