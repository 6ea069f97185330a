"""The config sections of the diagnostics, their alerts and the fault switches that test them.

Imports nothing heavy, like titanlite.config.job_config, which assembles them into JobConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from titanlite.config.fields import STEPS_MAX, due, opt, schedule


@dataclass
class Debug:
    ignore_all_labels_steps: list[int] = opt(
        [], "steps whose labels are all set to IGNORE_INDEX (tests the zero-token skip)"
    )
    nan_loss_step: int = opt(-1, "step at which the loss is made NaN (tests the non-finite stop)")
    sync_debug: bool = opt(
        False, "cuda: torch.cuda.set_sync_debug_mode('error') outside log steps, from the second step"
    )
    skip_memory_check: bool = opt(
        False, "start even if the memory estimate says the job does not fit (to find where it really stops)"
    )
    same_data: bool = opt(False, "fault: every rank reads rank 0's share of the batch")
    corrupt_labels_rank: int = opt(-1, "fault: this rank's labels are shuffled within each sequence")
    grad_noise_rank: int = opt(-1, "fault: this rank's gradient gets noise before the reduction")
    grad_noise_scale: float = opt(1.0, "std of that noise, relative to the gradient's RMS", at_least=0.0)
    slow_rank: int = opt(-1, "fault: this rank's data loading is slowed (a straggler)")
    slow_factor: float = opt(
        3.0, "slow_rank's steps take this many times their own time (extra host work)", above=1.0
    )
    fault_from_step: int = opt(
        1, "the step from which corrupt_labels_rank, grad_noise_rank and slow_rank act", at_least=1
    )
    sigkill_step: int = opt(
        -1, "fault: rank sigkill_rank is killed (SIGKILL) as this step starts, in a run's first attempt"
    )
    sigkill_rank: int = opt(0, "the rank that sigkill_step kills")
    signal_step: int = opt(
        -1, "fault: in signal_phase of this step, rank 0 sends SIGINT to its launcher, as a Ctrl-C would"
    )
    signal_phase: str = opt(
        "start",
        "the moment of signal_step: as it starts, in its eval, in its checkpoint save, or in the exports "
        "that end the run",
        choices=("start", "eval", "save", "export"),
    )
    hang_step: int = opt(-1, "fault: rank hang_rank stops responding as this step starts (comm timeout)")
    hang_rank: int = opt(0, "the rank that hang_step hangs")
    freeze_step: int = opt(-1, "fault: rank freeze_rank stops itself (SIGSTOP) in freeze_phase of this step")
    freeze_rank: int = opt(1, "the rank that freeze_step freezes")
    freeze_phase: str = opt(
        "forward",
        "the part of the step where freeze_step freezes",
        choices=("data", "forward", "backward", "clip", "optimizer", "checkpoint"),
    )
    fail_save_step: int = opt(
        -1, "fault: the last rank's checkpoint write at this step fails as on a full disk"
    )
    write_error: str = opt(
        "none",
        "fault: from write_error_step on, rank 0's writes into the run folder fail as on a full or read-only disk",
        choices=("none", "full", "read_only"),
    )
    write_error_step: int = opt(1, "the step whose log step write_error starts at", at_least=1)
    sigkill_in_save: int = opt(
        -1, "fault: rank 0 is killed inside this step's checkpoint save, before it is published"
    )
    spike_step: int = opt(-1, "fault: rank 0's loss is multiplied by spike_scale at this step (a spike)")
    spike_scale: float = opt(1000.0, "the factor of spike_step", above=0.0)
    flip_bit_step: int = opt(
        -1, "fault: as this step starts, one bit of one parameter flips on rank flip_bit_rank (replica_drift)"
    )
    flip_bit_rank: int = opt(1, "the rank whose parameter flip_bit_step flips")
    stuck_loader_step: int = opt(
        -1,
        "fault: from this step on, rank stuck_loader_rank's loader repeats that step's batch (stale_batch)",
    )
    stuck_loader_rank: int = opt(1, "the rank whose loader stuck_loader_step freezes")
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
    seed_mode: str = opt(
        "shared",
        "seeds of dropout and data order (S1-1/2/3 of arXiv 2602.14462); shared is the normal one",
        choices=("shared", "rank0_differs", "per_rank"),
    )

    def switches_on(self, names: tuple[str, ...] | None = None) -> list[str]:
        """The switches (of `names`; default every one) set away from their default, as
        "name = value"."""
        default = Debug()
        names = names if names is not None else tuple(f.name for f in fields(Debug))
        return [f"{n} = {v!r}" for n in names if (v := getattr(self, n)) != getattr(default, n)]

    def diagnosed_faults(self) -> list[str]:
        """The switches on whose faults the diagnostics' alerts are there to name."""
        return self.switches_on(DIAGNOSED_FAULTS)


# The [debug] faults an alert names (titanlite.components.faults); the others test the loop.
DIAGNOSED_FAULTS = (
    "same_data",
    "corrupt_labels_rank",
    "grad_noise_rank",
    "slow_rank",
    "flip_bit_step",
    "stuck_loader_step",
    "spike_step",
    "seed_mode",
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
    on_alert: str = opt("warn", "what an alert does: warn, or stop the run", choices=("warn", "stop"))
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
    spike_factor: float = opt(4.0, "dispersion_spike: loss std above this x its recent median", above=1.0)
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
        0.05, "single_rank_outlier: the rank's loss above the others' mean by this fraction", at_least=0.0
    )
    persist_frac: float = opt(
        0.7,
        "single_rank_outlier / faulty_worker: share of the window the same rank stands out",
        above=0.0,
        at_most=1.0,
    )
    identical_std: float = opt(1e-6, "identical_data: loss std below this fraction of the loss", at_least=0.0)
    identical_cos: float = opt(
        0.99, "identical_data: or mean gradient cosine above this", at_least=-1.0, at_most=1.0
    )
    cos_high: float = opt(
        0.5, "cosine_drop: armed while the median mean cosine is above this", at_least=-1.0, at_most=1.0
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
        0.1, "slow_rank: the rank's lateness at the step start, as a share of the step time", above=0.0
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
