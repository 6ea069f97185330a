"""The [faults] section: the switches of fault injection (titanlite.faults.inject), torch-free, so
that the launcher checks them before any worker starts."""

from __future__ import annotations

from dataclasses import fields

from titanlite.config.fields import opt, section
from titanlite.errors import UserError


@section
class FaultSwitches:
    """The [faults] section. Every switch is off by default."""

    ignore_all_labels_steps: list[int] = opt([])
    """steps whose labels are all set to IGNORE_INDEX (tests the zero-token skip)"""
    nan_loss_step: int = opt(-1)
    """step at which the loss is made NaN (tests the non-finite stop)"""
    same_data: bool = opt(False)
    """every rank reads rank 0's share of the batch"""
    corrupt_labels_rank: int = opt(-1)
    """this rank's labels are shuffled within each sequence"""
    grad_noise_rank: int = opt(-1)
    """this rank's gradient gets noise before the reduction"""
    grad_noise_scale: float = opt(1.0, at_least=0.0)
    """std of that noise, relative to the gradient's RMS"""
    slow_rank: int = opt(-1)
    """this rank's data loading is slowed (a straggler)"""
    slow_factor: float = opt(3.0, above=1.0)
    """slow_rank's steps take this many times their own time (extra host work)"""
    fault_from_step: int = opt(1, at_least=1)
    """the step from which corrupt_labels_rank, grad_noise_rank and slow_rank act"""
    sigkill_step: int = opt(-1)
    """rank sigkill_rank is killed (SIGKILL) as this step starts, in a run's first attempt"""
    sigkill_rank: int = opt(0)
    """the rank that sigkill_step kills"""
    signal_step: int = opt(-1)
    """in signal_phase of this step, rank 0 sends SIGINT to its launcher, as a Ctrl-C would"""
    signal_phase: str = opt("start", choices=("start", "eval", "save", "export"))
    """the moment of signal_step: as it starts, in its eval, in its checkpoint save, or in the exports that end the run"""
    hang_step: int = opt(-1)
    """rank hang_rank stops responding as this step starts (comm timeout)"""
    hang_rank: int = opt(0)
    """the rank that hang_step hangs"""
    freeze_step: int = opt(-1)
    """rank freeze_rank stops itself (SIGSTOP) in freeze_phase of this step"""
    freeze_rank: int = opt(1)
    """the rank that freeze_step freezes"""
    freeze_phase: str = opt(
        "forward", choices=("data", "forward", "backward", "clip", "optimizer", "checkpoint")
    )
    """the part of the step where freeze_step freezes"""
    fail_save_step: int = opt(-1)
    """the last rank's checkpoint write at this step fails as on a full disk"""
    write_error: str = opt("none", choices=("none", "full", "read_only"))
    """from write_error_step on, rank 0's writes into the run folder fail as on a full or read-only disk"""
    write_error_step: int = opt(1, at_least=1)
    """the step whose log step write_error starts at"""
    sigkill_in_save: int = opt(-1)
    """rank 0 is killed inside this step's checkpoint save, before it is published"""
    spike_step: int = opt(-1)
    """rank 0's loss is multiplied by spike_scale at this step (a spike)"""
    spike_scale: float = opt(1000.0, above=0.0)
    """the factor of spike_step"""
    flip_bit_step: int = opt(-1)
    """as this step starts, one bit of one parameter flips on rank flip_bit_rank (replica_drift)"""
    flip_bit_rank: int = opt(1)
    """the rank whose parameter flip_bit_step flips"""
    stuck_loader_step: int = opt(-1)
    """from this step on, rank stuck_loader_rank's loader repeats that step's batch (stale_batch)"""
    stuck_loader_rank: int = opt(1)
    """the rank whose loader stuck_loader_step freezes"""
    seed_mode: str = opt("shared", choices=("shared", "rank0_differs", "per_rank"))
    """seeds of dropout and data order (S1-1/2/3 of arXiv 2602.14462); shared is the normal one"""

    def switches_on(self, names: tuple[str, ...] | None = None) -> list[str]:
        """The switches (of `names`; default every one) set away from their default, as
        "name = value"."""
        default = FaultSwitches()
        names = names if names is not None else tuple(f.name for f in fields(self))
        return [f"{n} = {v!r}" for n in names if (v := getattr(self, n)) != getattr(default, n)]

    def diagnosed(self) -> list[str]:
        """The switches on whose faults the diagnostics' alerts are there to name."""
        return self.switches_on(DIAGNOSED)

    def check(self, diagnostics_on: bool, world: int) -> None:
        """The rules at `world` ranks (titanlite.validation runs them with the others)."""
        ranks = ["corrupt_labels_rank", "grad_noise_rank", "sigkill_rank", "hang_rank"]
        ranks += ["flip_bit_rank"] if self.flip_bit_step >= 0 else []
        ranks += ["stuck_loader_rank"] if self.stuck_loader_step >= 0 else []
        ranks += ["freeze_rank"] if self.freeze_step >= 0 else []
        for key in ranks:
            if getattr(self, key) >= world:
                raise UserError(
                    f"faults.{key} is {getattr(self, key)} but there are {world} ranks; use -1 or a rank below {world}"
                )
        if self.grad_noise_rank >= 0 and not (diagnostics_on and world > 1):
            raise UserError(
                "faults.grad_noise_rank: the diagnostics' gradient probe injects that noise, and they are off "
                "(diagnostics.enable = false or one rank); turn them on with 2 or more ranks, or set it to -1"
            )


# The faults an alert names; the others test the loop.
DIAGNOSED = (
    "same_data",
    "corrupt_labels_rank",
    "grad_noise_rank",
    "slow_rank",
    "flip_bit_step",
    "stuck_loader_step",
    "spike_step",
    "seed_mode",
)
