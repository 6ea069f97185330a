"""Which checkpoints a folder holds, whether they are intact, and whether this run may resume from
them. Torch-free for checkpoints that record their files: the launcher's preflight asks it before
any worker starts, the trainer again in rank 0.

A step folder's state.json records what the run trained on (titanlite.config.identity), the whole
config, the run folder that wrote it, and every other file of the step with its size (and, for
files up to CHECKSUM_MAX_BYTES, a CRC32); see components/checkpoint/checkpointer.py for the
layout. Sizes catch a truncated or missing file; the checksum, on the small files only, a
damaged one. The DCP shards get sizes alone: a CRC32 runs at about 3.5 GB/s on one core here, so
checking an 8B model's 96 GB (bf16 weights would be less; fp32 weights and AdamW's two moments)
would cost every launch about half a minute of CPU and a full read of the checkpoint.
A damaged step is set aside as `step-N.damaged` (never resumed, never pruned) and the run falls
back to the newest intact one.
"""

from __future__ import annotations

import json
import logging
import zipfile
import zlib
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import Any

from titanlite.config import JobConfig
from titanlite.config.identity import IDENTITY_KEYS, identity
from titanlite.config.layout import CHECKPOINT_MARKER as MARKER
from titanlite.errors import UserError

# Optimizer hyperparameters that a resume restores from the checkpoint (AdamW's param groups and
# the scheduler's base lr) unless checkpoint.restore_hparams is false.
RESTORED = ("optimizer.lr", "optimizer.beta1", "optimizer.beta2", "optimizer.eps", "optimizer.weight_decay")
CHECKSUM_MAX_BYTES = 64 * 2**20  # files up to this size get a CRC32 at save (RNG states, .metadata)
DAMAGED = ".damaged"  # suffix of a step folder set aside

logger = logging.getLogger("titanlite")


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


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(2**20):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_record(path: Path) -> dict[str, list]:
    """{name: [size, CRC32 or None]} of the files of the step folder being saved (all but
    state.json and the marker, which are written after it): what damage() checks."""
    out = {}
    for f in sorted(path.iterdir()):
        if f.is_file() and f.name not in ("state.json", MARKER):
            size = f.stat().st_size
            out[f.name] = [size, _crc32(f) if size <= CHECKSUM_MAX_BYTES else None]
    return out


def _dcp_extents(path: Path) -> dict[str, int]:
    """Bytes each DCP shard file must hold, from .metadata (file, offset, length of every item):
    how a checkpoint that records no file sizes is checked (imports torch)."""
    import torch.distributed.checkpoint as dcp

    ends: dict[str, int] = {}
    for info in dcp.FileSystemReader(str(path)).read_metadata().storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    return ends


def damage(path: Path) -> str | None:
    """What is wrong with the complete step folder `path`, naming the file; None if it is intact."""
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as e:
        return f"state.json is unreadable ({e})"
    if path.name[5:].isdigit() and state.get("step") != int(path.name[5:]):
        return f"state.json says step {state.get('step')}, its folder step {int(path.name[5:])}"
    files, exact = state.get("files"), True
    if files is None:  # written before steps recorded their files: what .metadata promises
        if not (path / ".metadata").is_file():
            return ".metadata is missing"
        try:
            files, exact = {name: [end, None] for name, end in _dcp_extents(path).items()}, False
        except Exception as e:  # noqa: BLE001 - an unreadable .metadata is damage, whatever the error
            return f".metadata is unreadable ({type(e).__name__})"
        files.update({f"rng-rank{r}.pt": [None, None] for r in range(state.get("world_size", 1))})
    for name, (size, crc) in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        have = f.stat().st_size
        if size is not None and (have != size if exact else have < size):
            return f"{name} holds {have:,} bytes, {'' if exact else 'at least '}{size:,} were written"
        if size is None and not zipfile.is_zipfile(f):  # an older step's RNG states (torch.save: a zip)
            return f"{name} is cut short or damaged"
        if crc is not None and _crc32(f) != crc:
            return f"{name} does not match the checksum it was written with"
    return None


def find(folder: Path, load_step: int) -> int | None:
    """The step to resume from (None: start fresh): the newest complete step that is intact
    (damage()), or the one checkpoint.load_step names, which must exist, be complete and intact."""
    steps = complete_steps(folder)
    if load_step >= 0:
        if load_step not in steps:
            have = ", ".join(map(str, steps)) or "none"
            raise UserError(
                f"checkpoint.load_step={load_step} but {folder} holds no complete checkpoint of that step "
                f"(complete: {have}); pick one of them or -1 for the newest"
            )
        why = damage(step_dir(folder, load_step))
        if why:
            raise UserError(
                f"checkpoint.load_step={load_step}: {step_dir(folder, load_step)} is damaged ({why}); "
                "pick another step, or -1 for the newest intact one"
            )
        return load_step
    damaged = []
    for step in reversed(steps):
        why = damage(step_dir(folder, step))
        if why is None:
            return step
        damaged.append(f"step {step}: {why}")
    if damaged:
        raise UserError(
            f"every checkpoint in {folder} is damaged ({'; '.join(damaged)}); start a new run (another "
            "--job.run_name) or from weights of your own (checkpoint.initial_load_path)"
        )
    return None


def quarantine(path: Path, why: str, wandb: bool = False) -> None:
    """Set the damaged step folder `path` aside as `<name>.damaged` (never resumed nor pruned),
    with one line naming what is wrong."""
    target = path.with_name(path.name + DAMAGED)
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{DAMAGED}-{n}")
    path.rename(target)
    again = "; steps after it are logged again in the same W&B run, which cannot rewind" if wandb else ""
    logger.warning(
        f"checkpoint {path} is damaged ({why}): set aside as {target.name}; the run falls back{again}"
    )


def quarantine_damaged(folder: Path, wandb: bool = False) -> None:
    """Set aside every damaged complete step newer than the newest intact one: what the holder of
    the run lock does before the run folder is opened, so a resume falls back to it."""
    for step in reversed(complete_steps(folder)):
        why = damage(step_dir(folder, step))
        if why is None:
            return
        quarantine(step_dir(folder, step), why, wandb)


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


def check_fits(path: Path, model_state: dict[str, Any]) -> None:
    """Every tensor of the model is in the checkpoint at `path` with the same shape (read from
    DCP's .metadata, before any weight moves); else one UserError naming the first that is not."""
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for name, tensor in model_state.items():
        have = saved.get(f"model.{name}")
        if have is None:
            raise UserError(f"checkpoint '{path}' holds no '{name}'; it is not a checkpoint of this model")
        if tuple(have.size) != tuple(tensor.shape):
            raise UserError(
                f"'{name}' in checkpoint '{path}' has shape {tuple(have.size)}, this model's "
                f"{tuple(tensor.shape)}; use the model (and tokenizer) that run trained"
            )


# Model args a resume may change: model.dropout is a training setting, like the optimizer's.
_MAY_CHANGE = frozenset({"dropout"})


def model_record(args: Any) -> dict[str, Any]:
    """A model's args (MetaModel.args) as state.json records them, for the resume check below."""
    raw = asdict(args) if is_dataclass(args) else dict(vars(args))
    return json.loads(json.dumps(raw, default=str))


def hf_config(cfg: JobConfig) -> dict[str, Any] | None:
    """model.hf_assets_path's config.json as the run read it (state.json keeps it, so a resume can
    name the key that changed); None without one."""
    if not cfg.model.hf_assets_path:
        return None
    return json.loads(
        (Path(cfg.model.hf_assets_path).expanduser() / "config.json").read_text(encoding="utf-8")
    )


def check_same_model(folder: Path, step: int, meta: Any, cfg: JobConfig) -> None:
    """The model this run builds (`meta`: a MetaModel) is the one checkpoint `step` trained: its
    args against those state.json recorded, else (older checkpoints) its parameter shapes against
    DCP's .metadata. A model.hf_assets_path's config.json is read anew by every launch, so an
    edit to it would otherwise reach the load as a size-mismatch traceback, or go unseen."""
    path = step_dir(folder, step)
    state = read_state(folder, step)
    saved = state.get("model_args")
    if saved is None:
        check_fits(path, dict(meta.model.named_parameters()))
        return
    ours = model_record(meta.args)
    diff = [
        f"{k} {saved[k]!r}, now {v!r}"
        for k, v in ours.items()
        if k in saved and k not in _MAY_CHANGE and saved[k] != v
    ]
    if not diff:
        return
    m = cfg.model
    what = f"{m.name} flavor '{m.flavor}' gives another model ({'; '.join(diff)})"
    if m.hf_assets_path:
        before, now = state.get("hf_config") or {}, hf_config(cfg) or {}
        keys = [
            f"{k} {before.get(k)!r}, now {now.get(k)!r}"
            for k in sorted({*before, *now})
            if before.get(k) != now.get(k)
        ]
        what = (
            f"{m.hf_assets_path}/config.json changed ({'; '.join(keys)})"
            if before and keys
            else f"model.hf_assets_path's config.json ({m.hf_assets_path}) gives another model ({'; '.join(diff)})"
        )
    raise UserError(
        f"the model changed since checkpoint {path} was written: {what}; restore it as it was, or start a "
        "new run under another job.run_name"
    )
