"""The built-in alerts, one record each, in the order the runner checks them. Their sources: the
anomaly tables of the Loss Dispersion and Gradient Direction Consistency Reference Manuals, on the
metrics of "Silent Inconsistency in Data-Parallel Full Fine-Tuning" (arXiv 2602.14462)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict

from titanlite.config.job_config import Alerts as AlertsConfig
from titanlite.diagnostics import rules
from titanlite.diagnostics.rank_sum import rank_outlier, rank_scores
from titanlite.diagnostics.registry import AlertSpec, Check, Context, Finding, Point, register
from titanlite.diagnostics.stragglers import slow_rank

# the [alerts] fields every rule past the burn-in reads (the window and its persistence)
_WINDOW = ("window", "min_steps", "persist_frac")


def _rule(fn, needs=None) -> Check:
    """A statistical rule of rules.py: it reads the window, past the burn-in (`needs`: see Check)."""
    return Check(lambda ctx: fn(ctx.window), burn_in=True, needs=needs)


def _data_check(fn) -> Check:
    """An exact data check of rules.py (no threshold, no burn-in) on the step's data (rules.read)."""

    def check(ctx: Context) -> Finding | None:
        now = rules.read(ctx.record)
        return fn(ctx, now) if now is not None else None

    return Check(check)


class Kept(dict):
    """A built-in alert's own state: plain values (lists, numbers), saved in checkpoints as they
    are; a resume at another layout starts them afresh (AlertMonitor.load_state_dict)."""

    def state_dict(self) -> dict:
        return dict(self)

    def load_state_dict(self, state: dict) -> None:
        self.update(state)


def _kept(**initial) -> Callable[[AlertsConfig, int, int], Kept]:
    """The state factory of an alert that keeps `initial`'s values."""
    return lambda cfg, world, unit: Kept(copy.deepcopy(initial))


def _stale(ctx: Context, now: list) -> Finding | None:
    """stale_batch, against the ranks' data at their previous measured step."""
    found = rules.stale(now, ctx.state["prev"])
    ctx.state["prev"] = now
    return found


def _rank_test(ctx: Context) -> Finding | None:
    """The per-sample rank test over the window of (step, z per rank) from the first measured
    step (its null needs no baseline; rank_sum.py)."""
    samples = ctx.record.get("rank_samples")
    if not samples or ctx.world < 2:
        return None
    losses = [[s["loss"] for s in rank if s.get("loss") is not None] for rank in samples]
    scores = ctx.state["scores"]
    scores.append([ctx.step, rank_scores(losses)])
    del scores[: -ctx.cfg.rank_test_window]
    named = ctx.named.get("single_rank_outlier", set())
    return rank_outlier(scores, [*ctx.history, ctx.point], ctx.cfg, ctx.explained, named)


def _replica_ranks(ctx: Context) -> int:
    """The ranks of one replica, as the step's record says (1 in a record without it)."""
    return int(ctx.record.get("replica_ranks", 1))


def _slow(ctx: Context) -> Finding | None:
    """slow_rank over its window of measured steps, from the first (timing needs no burn-in)."""
    recent = ctx.state["recent"]
    recent.append(asdict(ctx.point))
    del recent[: -ctx.cfg.slow_window]
    if ctx.world < 2:
        return None
    return slow_rank([Point(**p) for p in recent], ctx.cfg, ctx.explained)


def _replica_drift(ctx: Context) -> Finding | None:
    """A drifted replica stays so: each rank is named once until the replicas agree again."""
    drift = ctx.event["drift"]  # replicas.ReplicaCheck.compare's: None when every replica agrees
    named = ctx.state["ranks"]
    if drift is None:
        named.clear()
        return None
    if set(drift.ranks) <= set(named):
        return None
    named[:] = sorted(set(named) | set(drift.ranks))
    msg = (
        f"after step {ctx.step} the parameters of rank(s) {drift.ranks} differ bitwise from the other "
        f"replicas of their shard, first in {drift.parameter}"
    )
    return Finding("replica_drift", drift.ranks, msg, {"parameter": drift.parameter})


def _spike(ctx: Context) -> Finding:
    e = ctx.event  # titanlite.components.spike_guard.SpikeGuard.event's
    msg = (
        f"{e['metric']} {e['value']:.4g} above the spike guard's threshold {e['threshold']:.4g} "
        f"(mean + {e['k']:g} std of the last applied steps); its optimizer update was skipped "
        f"(scripts/inspect_step.py {e['run_dir']} --step {ctx.step} lists its sequences)"
    )
    return Finding("spike_skipped", [], msg, {"value": e["value"]})


BUILT_IN = (
    AlertSpec(
        "identical_data",
        "ranks read the same data (rank not passed to the loader?): audit the sharding",
        (_data_check(lambda ctx, now: rules.identical(now)), _rule(rules.identical_data)),
        thresholds=(*_WINDOW, "identical_std", "identical_cos"),
        explains=True,
    ),
    AlertSpec(
        "stale_batch",
        "that rank's data loader repeats a batch (a reader stuck on a stale buffer or cache): "
        "check its loader workers and storage, then resume from a checkpoint before the repeats",
        (_data_check(_stale),),
        state=_kept(prev=None),
        explains=True,
    ),
    AlertSpec(
        "data_order_mismatch",
        "the ranks shuffle the data with different seeds or epochs (per-rank sampler seeds), so "
        "some sequences are read twice and others never: give every rank's sampler the same seed",
        (_data_check(lambda ctx, now: rules.order_mismatch(ctx.record["data_order"])),),
        explains=True,
    ),
    AlertSpec(
        "shared_scalar_mismatch",
        "the ranks step with different values of what they must share (the global token count, the "
        "gradient norm and so the clip factor, the skip flag): a reduction over the wrong group or "
        "left out (a tensor-parallel plan's, a norm summed per mesh): run scripts/check_model.py on "
        "the model and layout",
        (
            Check(
                lambda ctx: rules.shared_mismatch(
                    ctx.record.get("rank_shared"), _replica_ranks(ctx)
                )
            ),
        ),
    ),
    AlertSpec(
        "single_rank_outlier",
        "a bad batch on that rank (corrupted, extreme or noisy samples): inspect its data",
        (Check(_rank_test), _rule(rules.single_rank_outlier)),
        thresholds=(*_WINDOW, "rank_test_alpha", "rank_test_window", "outlier_margin"),
        state=_kept(scores=[]),
    ),
    AlertSpec(
        "slow_rank",
        "a straggler, which the whole job waits for: if its data loading takes the extra time, its loader "
        "or storage; otherwise its host or device (a busy neighbour process, throttling: nvidia-smi -q -d PERFORMANCE)",
        (Check(_slow),),
        thresholds=("window", "persist_frac", "slow_window", "slow_margin"),
        state=_kept(recent=[]),
    ),
    AlertSpec(
        "batch_size_advice",
        "information, not an alert: the run is healthy",
        (Check(lambda ctx: rules.batch_advice(ctx.state, ctx.record, ctx.cfg, ctx.unit)),),
        level="info",
        thresholds=("advice_ratio", "advice_steps"),
        state=_kept(ratios=[], tokens=[], advised_ratio=0.0),
        cooldown=False,  # the advisor says it again only when the ratio moves a further fold
    ),
    AlertSpec(
        "dispersion_spike",
        "seed mismatch (dropout/augmentation) or shuffle desync: align the seeds, check the sampler's epoch",
        (_rule(rules.dispersion_spike),),
        thresholds=(*_WINDOW, "spike_factor", "smooth_loss_tol"),
    ),
    AlertSpec(
        "dispersion_rising_loss_falling",
        "ranks drifting apart while the average looks healthy: audit seeds, sharding and precision now",
        # armed past trend_burn_in, with trend_window points, the first past the burn-in's history
        (
            _rule(
                rules.dispersion_rising_loss_falling,
                lambda c: max(c.trend_burn_in + 1, 2 * c.min_steps + c.trend_window),
            ),
        ),
        thresholds=(*_WINDOW, "trend_burn_in", "trend_window", "trend_rise"),
    ),
    AlertSpec(
        "cosine_drop",
        "desynchronised seeds or data loader across ranks",
        (_rule(rules.cosine_drop),),
        thresholds=(*_WINDOW, "cos_high", "cos_low"),
    ),
    AlertSpec(
        "faulty_worker",
        "a faulty worker: possible silent data corruption or a failing device on that host",
        (
            _rule(rules.faulty_worker_direction),
            _rule(rules.faulty_worker_norm),
            _rule(rules.faulty_worker_norm_rise),
            _rule(rules.faulty_worker_norm_pair),
        ),
        thresholds=(*_WINDOW, "faulty_margin", "norm_outlier_factor", "own_recent"),
    ),
    AlertSpec(
        "spike_skipped",
        "a loss or gradient-norm spike: a bad batch (inspect the step's samples) or a learning rate too high",
        (Check(_spike),),
        source="spikes",
        cooldown=False,  # every skipped update is reported
    ),
    AlertSpec(
        "replica_drift",
        "silent data corruption or a failing device on that host (check its ECC errors: nvidia-smi -q -d ECC), "
        "or an op that is not deterministic across replicas; resume from the last checkpoint without that host",
        (Check(_replica_drift),),
        source="replicas",
        state=_kept(ranks=[]),
        cooldown=False,  # named once per rank until the replicas agree again
    ),
)

for _spec in BUILT_IN:
    register(_spec)
