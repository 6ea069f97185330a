"""Which checkpoints a folder holds and whether they are intact (whether this run may resume from
one: components/checkpoint/resume.py). Torch-free for checkpoints that record their files: the
launcher's preflight asks it before any worker starts, the trainer again in rank 0.

A step folder's state.json records what the run trained on (titanlite.config.fields), the whole
config, the run folder that wrote it, and every other file of the step with its size (and, for
files up to CHECKSUM_MAX_BYTES, a CRC32); see components/checkpoint/checkpointer.py for the
layout. Sizes catch a truncated or missing file; the checksum, on the small files only, a
damaged one. The DCP shards get sizes alone: checking an 8B model's 96 GB (bf16 weights would be
less; fp32 weights and AdamW's two moments) would cost every launch a CRC32 over every byte, a
full read of the checkpoint.
A damaged step is set aside as `step-N.damaged` (never resumed, never pruned) and the run falls
back to the newest intact one.
"""

from __future__ import annotations

import json
import logging
import zipfile
import zlib
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, TypeVar

from titanlite.components.checkpoint.format import MARKER
from titanlite.config import JobConfig
from titanlite.config.fields import whole_number
from titanlite.errors import UserError
from titanlite.tools.cache import first_cause

CHECKSUM_MAX_BYTES = 64 * 2**20  # files up to this size get a CRC32 at save (RNG states, .metadata)
ABANDONED = ".abandoned"  # a rewind's newer steps, set aside (set_aside_abandoned)
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
        if name.startswith("step-") and whole_number(name[5:]) and (d / MARKER).is_file():
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
    if whole_number(path.name[5:]) and state.get("step") != int(path.name[5:]):
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


def find(
    folder: Path,
    load_step: int,
    on_damaged: Callable[[Path, str], None] | None = None,
    exclude: Collection[int] = (),
    step_flag: str = "checkpoint.load_step",
) -> int | None:
    """The step to read (None: there is none): the newest complete step that is intact
    (damage()), or the one `load_step` names (>= 0), which must exist, be complete and intact.
    `on_damaged(step folder, why)` hears of each damaged newer step passed over; `exclude`: steps
    to pass over (ones that failed to load)."""
    steps = [s for s in complete_steps(folder) if s not in exclude]
    if load_step >= 0:
        if load_step not in steps:
            have = ", ".join(map(str, steps)) or "none"
            raise UserError(
                f"{step_flag} {load_step}: {folder} holds no complete checkpoint of that step "
                f"(complete: {have}); pick one of them{' or -1 for the newest' if step_flag.startswith('checkpoint') else ''}"
            )
        why = damage(step_dir(folder, load_step))
        if why:
            raise UserError(
                f"{step_flag} {load_step}: {step_dir(folder, load_step)} is damaged ({why}); "
                f"pick another step{', or -1 for the newest intact one' if step_flag.startswith('checkpoint') else ''}"
            )
        return load_step
    damaged = []
    for step in reversed(steps):
        why = damage(step_dir(folder, step))
        if why is None:
            return step
        damaged.append(f"step {step}: {why}")
        if on_damaged is not None:
            on_damaged(step_dir(folder, step), why)
    if damaged:
        raise UserError(
            f"every checkpoint in {folder} is damaged ({'; '.join(damaged)}); start a new run (another "
            "--job.run_name) or from weights of your own (checkpoint.initial_load_path)"
        )
    return None


def checkpoint_folder(cfg: JobConfig, run_dir: Path) -> Path:
    """checkpoint.folder; a relative one lives inside the run folder."""
    folder = Path(cfg.checkpoint.folder).expanduser()
    return folder if folder.is_absolute() else run_dir / folder


def is_step_folder(path: Path) -> bool:
    """A checkpoint's step folder (complete or not), as opposed to a run or checkpoint folder."""
    return (path / ".metadata").is_file() or (path / "state.json").is_file() or (path / MARKER).is_file()


def step_to_read(
    path: Path, step: int | None = None, flag: str = "RUN_DIR", exclude: Collection[int] = ()
) -> Path:
    """The complete, intact step folder a reader (export, generation, a new run's initial
    weights, any script) reads from `path`: a step folder itself, refused in one line naming
    what is wrong and the intact steps beside it if it is damaged; or a run folder (its
    checkpoint.folder, from its config.toml) or checkpoint folder: its newest intact step, or
    `step`, with one line for each damaged newer one passed over. Only reads."""
    if is_step_folder(path):
        if step is not None:
            raise UserError(
                f"--step picks a checkpoint of a run folder, but {flag} '{path}' is a step folder already"
            )
        if not (path / MARKER).is_file() or not (path / "state.json").is_file():
            raise UserError(
                f"{flag} '{path}' is incomplete (its save never finished); {_intact_beside(path)}"
            )
        why = damage(path)
        if why:
            raise UserError(f"{flag} '{path}' is damaged ({why}); {_intact_beside(path)}")
        return path
    if not path.is_dir():
        raise UserError(f"{flag} '{path}' is not a folder; give a run folder or a checkpoint step folder")
    folder = path
    if not complete_steps(path) and (path / "config.toml").is_file():
        from titanlite.config.manager import load_config

        folder = checkpoint_folder(load_config(str(path / "config.toml")), path)
    found = find(folder, -1 if step is None else step, _passed_over, exclude, "--step")
    if found is None:
        raise UserError(
            f"{flag} '{path}' holds no complete checkpoint (looked in '{folder}'); give a run folder that "
            "trained with checkpoint.every > 0 or checkpoint.at_end, or a step folder"
        )
    return step_dir(folder, found)


def _passed_over(path: Path, why: str) -> None:
    logger.warning(f"checkpoint {path} is damaged ({why}); reading the newest intact one before it")


def _intact_beside(path: Path) -> str:
    intact = [s for s in reversed(complete_steps(path.parent)) if damage(step_dir(path.parent, s)) is None]
    if not intact:
        return f"'{path.parent}' holds no intact checkpoint beside it"
    return "the intact ones beside it: " + ", ".join(str(step_dir(path.parent, s)) for s in intact[:3])


T = TypeVar("T")


def read_checkpoint(
    path: Path, read: Callable[[Path], T], step: int | None = None, flag: str = "RUN_DIR"
) -> T:
    """`read(step folder)` on the step step_to_read picks. A read that fails all the same
    (damage the sizes and checksums cannot see) counts as damage: from a run folder the next
    intact step is read instead, with one line; a step folder is refused in one line."""
    failed: list[int] = []
    while True:
        chosen = step_to_read(path, step, flag, failed)
        try:
            return read(chosen)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever DCP or torch.load raise on a damaged file
            why = first_cause(e)
            if chosen == path or step is not None:
                raise UserError(
                    f"checkpoint '{chosen}' failed to load ({why}); it is damaged: {_intact_beside(chosen)}"
                ) from None
            logger.warning(
                f"checkpoint {chosen} failed to load ({why}); reading the newest intact one before it"
            )
            failed.append(int(chosen.name[5:]))


def _set_aside(path: Path, suffix: str) -> Path:
    """Rename the step folder `path` to `<name><suffix>` (the first free one): a name no reader
    takes for a step, so it is never resumed nor pruned, and nothing is deleted."""
    target = path.with_name(path.name + suffix)
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{suffix}-{n}")
    path.rename(target)
    return target


def quarantine(path: Path, why: str, wandb: bool = False) -> None:
    """Set the damaged step folder `path` aside as `<name>.damaged` (never resumed nor pruned),
    with one line naming what is wrong."""
    target = _set_aside(path, DAMAGED)
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


def set_aside_abandoned(folder: Path, load_step: int) -> None:
    """A rewind (checkpoint.load_step below the newest step) abandons the steps after it: set
    them aside as `<name>.abandoned`, named in one line, so the run folder follows one timeline
    and a later plain resume continues the new one, not the abandoned."""
    steps = complete_steps(folder)
    if load_step < 0 or load_step not in steps:
        return  # no rewind, or a step the preflight refuses
    newer = [s for s in steps if s > load_step]
    targets = [_set_aside(step_dir(folder, s), ABANDONED).name for s in newer]
    if targets:
        logger.warning(
            f"checkpoint: resuming from step {load_step} (checkpoint.load_step) abandons the newer step(s) "
            f"{', '.join(map(str, newer))}: set aside as {', '.join(targets)} (kept; delete them when done)"
        )


def read_state(folder: Path, step: int) -> dict[str, Any]:
    path = step_dir(folder, step) / "state.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(
            f"checkpoint {path.parent} is unreadable ({e}); delete it to fall back to an older one"
        ) from None
