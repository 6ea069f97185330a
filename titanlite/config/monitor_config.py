"""The config sections of the diagnostics, their alerts and the debugging switches.

Imports nothing heavy, like titanlite.config.job_config, which assembles them into JobConfig.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.config.fields import STEPS_MAX, due, opt, schedule


@dataclass
class Debug:
    sync_debug: bool = opt(
        False,
        "cuda: torch.cuda.set_sync_debug_mode('error') outside log steps, from the second step",
    )
    skip_memory_check: bool = opt(
        False,
        "start even if the memory estimate says the job does not fit (to find where it really stops)",
    )
    fingerprint_step: int = opt(
        -1,
        "write per-module fingerprints of this step into <run folder>/fingerprints.json "
        "(scripts/invariance.py records step 1's: its gradient verdict and --localize compare two layouts' files)",
    )
    stop_after_step: int = opt(
        -1,
        "end the run after this step, as after its last (checkpoint saved if due); the schedule still "
        "runs to training.steps",
    )


@dataclass
class Diagnostics:
    enable: bool = opt(True, "cross-rank consistency diagnostics (need dp >= 2)")
    measure_first: int = opt(200, "measure every step for this many first steps", at_least=0)
    every: int = schedule(500, "after measure_first, measure")
    method: str = opt(
        "auto",
        "gradient directions: exact (Gram), sketch (CountSketch); auto: exact unless it would hold "
        "unsharded grads across microbatches (fsdp with accumulation), under hsdp, or past dp = sketch_dim / 4",
        choices=("auto", "exact", "sketch"),
    )
    sketch_dim: int = opt(
        1024,
        "k, dimensions of each local gradient's sketch (rounded down to a prime)",
        at_least=16,
        at_most=1 << 20,
    )
    noise_scale_ema: float = opt(
        0.9, "EMA decay of the gradient-noise-scale estimate", at_least=0.0, below=1.0
    )
    on_alert: str = opt(
        "warn", "what an alert does: warn, or stop the run", choices=("warn", "stop")
    )
    console: str = opt(
        "short",
        "a measured step on the console: short (the ranks' loss and grad-norm spread on the step line), "
        "full (a diag line of every figure), off; diagnostics.jsonl and TensorBoard hold them all",
        choices=("short", "full", "off"),
    )
    replica_check_every: int = schedule(
        100, "replica_drift: compare the replicas' parameters bitwise (ddp, hsdp)"
    )

    def measures(self, step: int) -> bool:
        """Whether `step` is a measured step."""
        return step <= self.measure_first or due(step, self.every)

    def measured_steps(self, last: int) -> int:
        """How many of the steps 1..last `measures` (the first measure_first, then the multiples
        of `every` past them)."""
        first = min(last, self.measure_first)
        later = last // self.every - first // self.every if self.every > 0 else 0
        return first + max(later, 0)


@dataclass
class Alerts:
    """The thresholds of the named alerts' rules (titanlite.diagnostics.rules)."""

    window: int = opt(
        20,
        "measured steps that persistence rules look back on; alert cooldown",
        at_least=3,
        at_most=STEPS_MAX,
    )
    min_steps: int = opt(
        10,
        "burn-in: measured steps ignored before alerts, then history they need",
        at_least=1,
        at_most=STEPS_MAX,
    )
    spike_factor: float = opt(
        4.0, "dispersion_spike: loss std above this x its recent median", above=1.0
    )
    smooth_loss_tol: float = opt(
        0.05, "dispersion_spike: global loss within this fraction of its recent median", above=0.0
    )
    trend_burn_in: int = opt(
        100,
        "dispersion_rising_loss_falling: measured steps before it is armed",
        at_least=0,
        at_most=STEPS_MAX,
    )
    trend_window: int = opt(
        100,
        "dispersion_rising_loss_falling: measured steps it looks back on (medians of thirds)",
        at_least=3,
        at_most=STEPS_MAX,
    )
    trend_rise: float = opt(
        1.0,
        "dispersion_rising_loss_falling: rise of the median std, last vs first third of trend_window",
        above=0.0,
    )
    outlier_margin: float = opt(
        0.05,
        "single_rank_outlier: the rank's loss above the others' mean by this fraction",
        at_least=0.0,
    )
    persist_frac: float = opt(
        0.7,
        "single_rank_outlier / faulty_worker: share of the window the same rank stands out",
        above=0.0,
        at_most=1.0,
    )
    identical_std: float = opt(
        1e-6, "identical_data: loss std below this fraction of the loss", at_least=0.0
    )
    identical_cos: float = opt(
        0.99, "identical_data: or mean gradient cosine above this", at_least=-1.0, at_most=1.0
    )
    cos_high: float = opt(
        0.5,
        "cosine_drop: armed while the median mean cosine is above this",
        at_least=-1.0,
        at_most=1.0,
    )
    cos_low: float = opt(
        0.05, "cosine_drop: fires when the mean cosine falls below this", at_least=-1.0, at_most=1.0
    )
    faulty_margin: float = opt(
        0.1, "faulty_worker: rank's median cosine to others below theirs by this", at_least=0.0
    )
    norm_outlier_factor: float = opt(
        3.0,
        "faulty_worker: or its grad norm this many x the others' median, or x its own recent history",
        above=1.0,
    )
    own_recent: int = opt(
        3,
        "faulty_worker: measured steps whose median norm is compared with the rank's history",
        at_least=1,
        at_most=STEPS_MAX,
    )
    rank_test_alpha: float = opt(
        1e-5,
        "single_rank_outlier's per-sample rank test: false alarms per measured step at most (union bound)",
        above=0.0,
        below=1.0,
    )
    rank_test_window: int = opt(
        10,
        "single_rank_outlier's per-sample rank test: measured steps it combines",
        at_least=1,
        at_most=STEPS_MAX,
    )
    slow_window: int = opt(
        10,
        "slow_rank: measured steps it looks back on (persist_frac of them the same rank)",
        at_least=2,
        at_most=STEPS_MAX,
    )
    slow_margin: float = opt(
        0.1,
        "slow_rank: the rank's lateness at the step start, as a share of the step time",
        above=0.0,
    )
    advice_ratio: float = opt(
        4.0,
        "batch_size_advice: gradient noise scale over the batch (tokens) beyond this, or below 1/this",
        above=1.0,
    )
    advice_steps: int = opt(
        50,
        "batch_size_advice: measured steps the ratio must stay beyond advice_ratio",
        at_least=1,
        at_most=STEPS_MAX,
    )
