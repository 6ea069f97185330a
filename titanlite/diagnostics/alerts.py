"""Alerts: the record of one (`Alert`, a line of events.jsonl) and the one runner of every
registered alert (`AlertMonitor`). A pure function of the observations, so every rank gives the
same verdict and a recorded diagnostics.jsonl replays (replay.py). An alert fires at most once per
`window` measured steps per (name, rank). The first `min_steps` measured steps are a burn-in, not
even a baseline: early training is not representative (dispersion rises from ~0, gradients agree
strongly at first). Exact checks, the rank test, timing and the advice run from the first."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field

import titanlite.diagnostics.catalogue  # noqa: F401  (registers the built-in alerts)
from titanlite.config.job_config import Alerts as AlertsConfig
from titanlite.datasets.corpus import source_name
from titanlite.diagnostics.registry import (
    REGISTRY,
    AlertSpec,
    Context,
    Finding,
    Point,
    Window,
    cause,
    point,
)
from titanlite.diagnostics.rules import SPREAD_ONLY

STATE_VERSION = 2  # of AlertMonitor.state_dict; a checkpoint's of another starts the history again


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
    # or "info": a note (batch_size_advice) that neither counts nor stops a run
    level: str = "alert"

    def __post_init__(self) -> None:
        self.cause = self.cause or cause(self.name)

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
        worst = sorted(self.samples, key=lambda s: 1.0 if s.get("loss") is None else -s["loss"])
        shown = ", ".join(_sample(s) for s in worst[:SHOWN_SAMPLES])
        more = len(self.samples) - SHOWN_SAMPLES
        rest = f"; {more} more in events.jsonl" if more > 0 else ""
        has_loss = any(s.get("loss") is not None for s in worst)
        label = "highest-loss samples" if has_loss else "samples"
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
    """The one runner of every registered alert (registry.REGISTRY, in its order). `hosts`: per
    rank; `batch_unit`: sequences the global batch moves by with the layout kept (dp x local
    batch), for the batch-size advice's flag."""

    def __init__(self, cfg: AlertsConfig, hosts: list[str], batch_unit: int = 0, per_rank: int = 0):
        self.cfg = cfg
        self.hosts = hosts
        self.world = len(hosts)
        self.per_rank = per_rank  # sequences each rank scores per step: its losses' spread scales
        self.specs: tuple[AlertSpec, ...] = tuple(REGISTRY.values())
        self.unit = batch_unit or self.world
        stateful = [s for s in self.specs if s.state is not None]
        self.states = {s.name: s.state(cfg, self.world, self.unit) for s in stateful}
        self.named: dict[str, set[int]] = {}  # alert -> the ranks it has named in this run
        self.history: deque[Point] = deque(maxlen=cfg.window)  # the rules' points, past the burn-in
        self.trend: deque[tuple[float, float]] = deque(maxlen=cfg.trend_window)  # (loss, loss_std)
        self.seen = 0  # measured steps
        self._last: dict[tuple[str, int], int] = {}  # (alert, rank key) -> measured step last fired
        # (data check, rank) -> measured step it last failed: what explains a rank's statistics
        self._data_failed: dict[tuple[str, int], int] = {}

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "world": self.world,
            "per_rank": self.per_rank,
            "history": [asdict(p) for p in self.history],
            "trend": [list(t) for t in self.trend],
            "seen": self.seen,
            "last": [[name, rank, seen] for (name, rank), seen in self._last.items()],
            "data_failed": [[name, rank, seen] for (name, rank), seen in self._data_failed.items()],
            "named": {name: sorted(ranks) for name, ranks in self.named.items()},
            "alerts": {name: state.state_dict() for name, state in self.states.items()},
        }

    def load_state_dict(self, state: dict) -> str | None:
        """Continue from a checkpoint's state; at another layout, start the rules' history again
        and return the note that says so (None otherwise)."""
        again = f"a burn-in of alerts.min_steps = {self.cfg.min_steps} measured steps"
        if state.get("version") != STATE_VERSION:
            return (
                f"diagnostics: the checkpoint's alert history is of another format (version "
                f"{state.get('version', 1)}, this titanlite's {STATE_VERSION}); the alert rules start again ({again})"
            )
        self.named = {name: set(ranks) for name, ranks in state["named"].items()}
        world, per_rank = state["world"], state["per_rank"]
        if (world, per_rank) != (self.world, self.per_rank):
            # The spread of per-rank losses and norms, the gaps and the cosines scale with the
            # ranks and the sequences each scores: a history from another layout would read as
            # a drift that the layout made (a dispersion that rose by construction).
            return (
                f"diagnostics: resumed at dp={self.world} with {self.per_rank} sequence(s) per rank per step, where "
                f"the checkpoint's run had dp={world} with {per_rank}; the alert rules' statistics depend on both, "
                f"so their history starts again here ({again})"
            )
        self.history = deque((Point(**p) for p in state["history"]), maxlen=self.cfg.window)
        self.trend = deque((tuple(t) for t in state["trend"]), maxlen=self.cfg.trend_window)
        self.seen = state["seen"]
        self._last = {(name, rank): seen for name, rank, seen in state["last"]}
        self._data_failed = {(name, rank): seen for name, rank, seen in state["data_failed"]}
        for name, alert_state in state["alerts"].items():
            if name in self.states:  # an alert no longer registered leaves its state behind
                self.states[name].load_state_dict(alert_state)
        return None

    def _explained(self, name: str | None, rank: int | None) -> bool:
        """Whether a data check (`name`, any if None) failed for `rank` (any if None) within the
        window: it names the cause, so statistical rules about the same ranks stay quiet."""
        return any(
            (name is None or n == name)
            and (rank is None or r == rank)
            and self.seen - seen < self.cfg.window
            for (n, r), seen in self._data_failed.items()
        )

    def _raise(
        self, spec: AlertSpec, step: int, found: Finding | list[Finding] | None
    ) -> list[Alert]:
        """The alerts of a check's findings: the spec's name, cause and level (whatever name a
        finding carries), the cooldown, the ranks named, a data check's explanation, the hosts."""
        out = []
        for f in [found] if isinstance(found, Finding) else found or []:
            if spec.explains:  # even when the cooldown keeps it quiet: the cause stays known
                self._data_failed.update({(spec.name, r): self.seen for r in f.ranks})
            if spec.cooldown:
                key = (spec.name, f.key if f.key is not None else f.ranks[0] if f.ranks else -1)
                if self.seen - self._last.get(key, -(10**9)) < self.cfg.window:
                    continue
                self._last[key] = self.seen
                self.named.setdefault(spec.name, set()).update(f.ranks)
            hosts = [self.hosts[r] for r in f.ranks]
            alert = Alert(spec.name, step, f.ranks, hosts, f.message, spec.cause, f.values)
            alert.level = spec.level
            out.append(alert)
        return out

    def update(self, rec: dict) -> list[Alert]:
        """The alerts a measured-step record raises: every check that needs no history, in the
        registry's order, then, past the burn-in, every rule that reads the window."""
        p = point(rec)
        if p is None:
            return []
        self.seen += 1
        history = list(self.history)
        out = self._checks("measured", p.step, False, record=rec, point=p, history=history)
        if self.seen <= self.cfg.min_steps:
            return out  # burn-in: not even a baseline
        self.history.append(p)
        if len(history) < self.cfg.min_steps:
            return out
        self.trend.append((p.loss, p.loss_std))
        trend, named = list(self.trend), self.named
        window = Window(self.cfg, p, history, trend, self.seen, self.world, self._explained, named)
        return out + self._checks(
            "measured", p.step, True, record=rec, point=p, history=history, window=window
        )

    def observe(self, source: str, step: int, event: dict) -> list[Alert]:
        """The alerts of an observation other than a measured step ("spikes": the spike guard
        skipped `step`'s update; "replicas": the replicas compared after `step`)."""
        return self._checks(source, step, None, event=event)

    def _checks(self, source: str, step: int, burn_in: bool | None, **seen_now) -> list[Alert]:
        """The alerts of every `source` check with this `burn_in` (None: every check), in the
        registry's order."""
        out = []
        for spec in (s for s in self.specs if s.source == source):
            ctx = Context(
                spec,
                self.cfg,
                step,
                self.world,
                self.seen,
                self.states.get(spec.name),
                self._explained,
                self.named,
                self.unit,
                **seen_now,
            )
            for check in (c for c in spec.checks if burn_in in (None, c.burn_in)):
                out += self._raise(spec, step, check.fn(ctx))
        return out


def history_note(cfg: AlertsConfig, measured: int, world: int) -> str | None:
    """One sentence on the measured-step alerts that `measured` measured steps are too few for:
    those whose latest check (Check.first_judged) judges later; at dp=2 not the alerts that only
    compare 3 or more ranks, which never judge there (rules.silent_rules_note)."""
    skip = SPREAD_ONLY if world == 2 else ()
    by_step: dict[int, list[str]] = {}
    for spec in REGISTRY.values():
        judged = max(check.first_judged(cfg) for check in spec.checks)
        if spec.source == "measured" and spec.name not in skip and judged > measured:
            by_step.setdefault(judged, []).append(spec.name)
    if not by_step:
        return None
    parts = [
        f"{', '.join(names)} from measured step {judged}"
        for judged, names in sorted(by_step.items())
    ]
    return (
        f"{measured} measured step(s) are too few for some alerts, which judge only after a burn-in of "
        f"alerts.min_steps = {cfg.min_steps} steps and as many of history: {'; '.join(parts)}; the checks "
        "that need no history judge from the first step"
    )
