"""Config keys that were renamed, moved to another section or split, and what an old value means
now. An older config file, a --section.key flag, a run folder's config.toml and a checkpoint's
state.json naming them still load and mean what they meant, with one note that names the new
keys (titanlite.config.manager); a resume compares old settings by their new names, so a moved
key is never reported as a changed setting."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Split:
    """An old key whose value now sets several keys: `to(value)`, value checked as `typ`."""

    typ: type
    to: Callable[[Any], dict[str, Any]]

    def __str__(self) -> str:
        return " + ".join(self.to(self.typ()))


def _checkpoint_interval(n: int) -> dict[str, Any]:
    # checkpoint.interval N saved every N steps and after the last one; 0 never saved.
    return {"checkpoint.every": n, "checkpoint.at_end": n > 0}


_ALERTS = (
    "spike_factor",
    "smooth_loss_tol",
    "trend_burn_in",
    "trend_window",
    "trend_rise",
    "outlier_margin",
    "persist_frac",
    "identical_std",
    "identical_cos",
    "cos_high",
    "cos_low",
    "faulty_margin",
    "norm_outlier_factor",
)

# The fault switches that [debug] held, now the [faults] plugin's section (titanlite.faults)
_FAULTS = (
    "ignore_all_labels_steps",
    "nan_loss_step",
    "same_data",
    "corrupt_labels_rank",
    "grad_noise_rank",
    "grad_noise_scale",
    "slow_rank",
    "slow_factor",
    "fault_from_step",
    "sigkill_step",
    "sigkill_rank",
    "signal_step",
    "signal_phase",
    "hang_step",
    "hang_rank",
    "freeze_step",
    "freeze_rank",
    "freeze_phase",
    "fail_save_step",
    "write_error",
    "write_error_step",
    "sigkill_in_save",
    "spike_step",
    "spike_scale",
    "flip_bit_step",
    "flip_bit_rank",
    "stuck_loader_step",
    "stuck_loader_rank",
    "seed_mode",
)

MOVED_KEYS: dict[str, str | Split] = {
    **{f"debug.{k}": f"faults.{k}" for k in _FAULTS},
    "diagnostics.alert_window": "alerts.window",
    "diagnostics.alert_min_steps": "alerts.min_steps",
    **{f"diagnostics.{k}": f"alerts.{k}" for k in _ALERTS},
    # the schedule fields: one rule (titanlite.config.fields.schedule), end-of-run switches apart
    "checkpoint.interval": Split(int, _checkpoint_interval),
    "eval.interval": "eval.every",
    "metrics.log_freq": "metrics.log_every",
    "diagnostics.warmup_steps": "diagnostics.measure_first",
    "diagnostics.interval": "diagnostics.every",
    "diagnostics.replica_check_interval": "diagnostics.replica_check_every",
    # the spike guard is training control, beside the optimizer
    "diagnostics.skip_spikes": "spike_guard.skip",
    "diagnostics.spike_k": "spike_guard.k",
    "diagnostics.spike_window": "spike_guard.window",
    "diagnostics.spike_min_history": "spike_guard.min_history",
    "diagnostics.spike_max_consecutive": "spike_guard.max_consecutive",
}


def new_values(old: str, value: Any) -> dict[str, Any]:
    """{new key: value} that old key `old` set to `value` means now."""
    entry = MOVED_KEYS[old]
    return {entry: value} if isinstance(entry, str) else entry.to(value)
