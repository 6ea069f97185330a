"""Which checkpoints a folder holds, and whether this run may resume from them. Torch-free: the
launcher's preflight asks it before any worker starts, the trainer again in rank 0.

A step folder's state.json records what the run trained on (titanlite.config.identity), the whole
config, and the run folder that wrote it; see components/checkpoint/checkpointer.py for the layout.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from titanlite.config import JobConfig
from titanlite.config.identity import IDENTITY_KEYS, identity
from titanlite.config.layout import CHECKPOINT_MARKER as MARKER
from titanlite.errors import UserError

# Optimizer hyperparameters that a resume restores from the checkpoint (AdamW's param groups and
# the scheduler's base lr) unless checkpoint.restore_hparams is false.
RESTORED = ("optimizer.lr", "optimizer.beta1", "optimizer.beta2", "optimizer.eps", "optimizer.weight_decay")


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step:08d}"


def complete_steps(folder: Path) -> list[int]:
    """Steps of the published, complete checkpoints in `folder`, oldest first."""
    if not folder.is_dir():
        return []
    steps = []
    for d in folder.iterdir():
        name = d.name
        if name.startswith("step-") and name[5:].isdigit() and (d / MARKER).is_file():
            steps.append(int(name[5:]))
    return sorted(steps)


def find(folder: Path, load_step: int) -> int | None:
    """The step to resume from (None: start fresh); a named step must exist and be complete."""
    steps = complete_steps(folder)
    if load_step < 0:
        return steps[-1] if steps else None
    if load_step not in steps:
        have = ", ".join(map(str, steps)) or "none"
        raise UserError(
            f"checkpoint.load_step={load_step} but {folder} holds no complete checkpoint of that step "
            f"(complete: {have}); pick one of them or -1 for the newest"
        )
    return load_step


def read_state(folder: Path, step: int) -> dict[str, Any]:
    path = step_dir(folder, step) / "state.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(
            f"checkpoint {path.parent} is unreadable ({e}); delete it to fall back to an older one"
        ) from None


# The optimizer state's layout in a checkpoint: AdamW's weight-decay groups, each marked with
# whether it decays (components/optimizer.py: param_groups). Checkpoints before them had none.
OPTIMIZER_GROUPS = "decay_groups"


def optimizer_groups_error(path: Path) -> str:
    return (
        f"checkpoint '{path}' holds its optimizer state without titanlite's weight-decay groups (it was "
        "written before them), so it cannot resume; start a new run from its weights with "
        f"checkpoint.initial_load_path = '{path}' (initial_load_model_only = true)"
    )


def check_resumable(folder: Path, step: int, cfg: JobConfig, run_dir: Path) -> dict[str, Any]:
    """Refuse, in one line, a checkpoint trained on something else, or one in a folder outside
    this run folder that another run folder wrote (resuming would write this run's checkpoints
    into that run's folder and prune its older ones). A checkpoint inside the run folder is the
    run's own, even if the folder was moved or copied. Returns its state.json."""
    state = read_state(folder, step)
    owner, mine = state.get("run_folder"), run_dir.resolve()
    if owner and Path(owner) != mine and not folder.resolve().is_relative_to(mine):
        raise UserError(
            f"checkpoint.folder '{folder}' holds the checkpoints of run '{owner}'; to start a new run "
            f"from one, set checkpoint.initial_load_path = '{step_dir(folder, step)}' (add "
            "checkpoint.initial_load_model_only = false to keep its optimizer), or resume that run "
            "with its own --job.run_name"
        )
    if state.get("optimizer_groups") != OPTIMIZER_GROUPS:
        raise UserError(optimizer_groups_error(step_dir(folder, step)))
    # A key that joined the identity after the checkpoint was written had its default then.
    theirs, ours = {**identity(JobConfig()), **state.get("identity", {})}, identity(cfg)
    diff = [f"{k}: checkpoint {theirs.get(k)!r}, config {v!r}" for k, v in ours.items() if theirs.get(k) != v]
    if diff:
        raise UserError(
            f"checkpoint {step_dir(folder, step)} was trained on something else ({'; '.join(diff)}); "
            "use a matching config, another checkpoint.folder, or start a new run"
        )
    return state


def flat_config(cfg: JobConfig) -> dict[str, Any]:
    """{"section.key": value} of every field: what state.json keeps of the config."""
    out = {}
    for sf in fields(cfg):
        section = getattr(cfg, sf.name)
        for f in fields(section):
            out[f"{sf.name}.{f.name}"] = getattr(section, f.name)
    return out


def resume_changes(state: dict[str, Any], cfg: JobConfig) -> list[str]:
    """One line per config value that differs from the checkpoint's run, with what takes effect."""
    before, step = state.get("config"), state["step"]
    if not before:  # written before state.json kept the config
        return []
    lines = []
    for key, now in flat_config(cfg).items():
        if key in IDENTITY_KEYS or key == "checkpoint.load_step" or key not in before or before[key] == now:
            continue
        if key in RESTORED and cfg.checkpoint.restore_hparams:
            effect = (
                "not applied: the checkpoint's value is restored "
                "(--checkpoint.restore_hparams false applies this config's)"
            )
        elif key in RESTORED:
            effect = f"applied from step {step + 1} (checkpoint.restore_hparams = false)"
        elif key.startswith("lr_scheduler.") or key == "training.steps":
            effect = f"applied: the schedule continues at step {step + 1} under the new setting"
        else:
            effect = "applied"
        lines.append(f"resume: {key} was {before[key]!r}, now {now!r}: {effect}")
    return lines
