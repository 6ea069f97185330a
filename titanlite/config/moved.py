"""Config keys that moved, and where they live now: an older config file, a --section.key flag, a
run folder's config.toml and a checkpoint's state.json naming them still load and mean what they
meant, with one note that names the new keys (titanlite.config.manager); a resume compares old
settings by their new names, so a moved key is never reported as a changed setting."""

from __future__ import annotations

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

MOVED_KEYS: dict[str, str] = {f"debug.{k}": f"faults.{k}" for k in _FAULTS}
