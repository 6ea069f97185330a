"""The config sections of the diagnostics, their alerts and the debugging switches (torch-free,
like titanlite.config.job_config, which assembles them into JobConfig)."""

from __future__ import annotations

from titanlite.config.fields import STEPS_MAX, due, opt, schedule, section


@section
class Debug:
    sync_debug: bool = opt(False)
    """cuda: torch.cuda.set_sync_debug_mode('error') outside log steps, from the second step"""
    skip_memory_check: bool = opt(False)
    """start even if the memory estimate says the job does not fit (to find where it really stops)"""
    fingerprint_step: int = opt(-1)
    """write per-module fingerprints of this step into <run folder>/fingerprints.json (scripts/invariance.py records step 1's: its gradient verdict and --localize compare two layouts' files)"""
    stop_after_step: int = opt(-1)
    """end the run after this step, as after its last (checkpoint saved if due); the schedule still runs to training.steps"""


@section
class Diagnostics:
    enable: bool = opt(True)
    """cross-rank consistency diagnostics (need dp >= 2)"""
    measure_first: int = opt(200, at_least=0)
    """measure every step for this many first steps"""
    every: int = schedule(500, "after measure_first, measure")
    method: str = opt("auto", choices=("auto", "exact", "sketch"))
    """gradient directions: exact (Gram), sketch (CountSketch); auto: exact unless it would hold unsharded grads across microbatches (fsdp with accumulation), under hsdp or ddp with a tensor split, or past dp = sketch_dim / 4"""
    sketch_dim: int = opt(1024, at_least=16, at_most=1 << 20)
    """k, dimensions of each local gradient's sketch (rounded down to a prime)"""
    noise_scale_ema: float = opt(0.9, at_least=0.0, below=1.0)
    """EMA decay of the gradient-noise-scale estimate"""
    on_alert: str = opt("warn", choices=("warn", "stop"))
    """what an alert does: warn, or stop the run"""
    console: str = opt("short", choices=("short", "full", "off"))
    """a measured step on the console: short (the ranks' loss and grad-norm spread on the step line), full (a diag line of every figure), off; diagnostics.jsonl and TensorBoard hold them all"""
    replica_check_every: int = schedule(
        100, "replica_drift: compare the replicas' parameters bitwise (ddp, hsdp)"
    )

    def measures(self, step: int) -> bool:
        """Whether `step` is a measured step."""
        return step <= self.measure_first or due(step, self.every)

    def measured_steps(self, last: int) -> int:
        """How many of the steps 1..last `measures`."""
        first = min(last, self.measure_first)
        later = last // self.every - first // self.every if self.every > 0 else 0
        return first + max(later, 0)


@section
class Alerts:
    """The thresholds of the named alerts' rules (titanlite.diagnostics.rules)."""

    window: int = opt(20, at_least=3, at_most=STEPS_MAX)
    """measured steps that persistence rules look back on; alert cooldown"""
    min_steps: int = opt(10, at_least=1, at_most=STEPS_MAX)
    """burn-in: measured steps ignored before alerts, then history they need"""
    spike_factor: float = opt(4.0, above=1.0)
    """dispersion_spike: loss std above this x its recent median"""
    smooth_loss_tol: float = opt(0.05, above=0.0)
    """dispersion_spike: global loss within this fraction of its recent median"""
    trend_burn_in: int = opt(100, at_least=0, at_most=STEPS_MAX)
    """dispersion_rising_loss_falling: measured steps before it is armed"""
    trend_window: int = opt(100, at_least=3, at_most=STEPS_MAX)
    """dispersion_rising_loss_falling: measured steps it looks back on (medians of thirds)"""
    trend_rise: float = opt(1.0, above=0.0)
    """dispersion_rising_loss_falling: rise of the median std, last vs first third of trend_window"""
    outlier_margin: float = opt(0.05, at_least=0.0)
    """single_rank_outlier: the rank's loss above the others' mean by this fraction"""
    persist_frac: float = opt(0.7, above=0.0, at_most=1.0)
    """single_rank_outlier / faulty_worker: share of the window the same rank stands out"""
    identical_std: float = opt(1e-6, at_least=0.0)
    """identical_data: loss std below this fraction of the loss"""
    identical_cos: float = opt(0.99, at_least=-1.0, at_most=1.0)
    """identical_data: or mean gradient cosine above this"""
    cos_high: float = opt(0.5, at_least=-1.0, at_most=1.0)
    """cosine_drop: armed while the median mean cosine is above this"""
    cos_low: float = opt(0.05, at_least=-1.0, at_most=1.0)
    """cosine_drop: fires when the mean cosine falls below this"""
    faulty_margin: float = opt(0.1, at_least=0.0)
    """faulty_worker: rank's median cosine to others below theirs by this"""
    norm_outlier_factor: float = opt(3.0, above=1.0)
    """faulty_worker: or its grad norm this many x the others' median, or x its own recent history"""
    own_recent: int = opt(3, at_least=1, at_most=STEPS_MAX)
    """faulty_worker: measured steps whose median norm is compared with the rank's history"""
    rank_test_alpha: float = opt(1e-5, above=0.0, below=1.0)
    """single_rank_outlier's per-sample rank test: false alarms per measured step at most (union bound)"""
    rank_test_window: int = opt(10, at_least=1, at_most=STEPS_MAX)
    """single_rank_outlier's per-sample rank test: measured steps it combines"""
    slow_window: int = opt(10, at_least=2, at_most=STEPS_MAX)
    """slow_rank: measured steps it looks back on (persist_frac of them the same rank)"""
    slow_margin: float = opt(0.1, above=0.0)
    """slow_rank: the rank's lateness at the step start, as a share of the step time"""
    advice_ratio: float = opt(4.0, above=1.0)
    """batch_size_advice: gradient noise scale over the batch (tokens) beyond this, or below 1/this"""
    advice_steps: int = opt(50, at_least=1, at_most=STEPS_MAX)
    """batch_size_advice: measured steps the ratio must stay beyond advice_ratio"""
