"""Which steps a checkpoint folder holds and whether they are intact (torch-free: the preflight
asks it, the trainer again). state.json records every other file's size and, up to
CHECKSUM_MAX_BYTES, its CRC32: the DCP shards get sizes alone, as a CRC32 of an 8B model's 96 GB
would cost every launch a full read. A damaged step is set aside as `step-N.damaged`."""

from __future__ import annotations

import json
import logging
import os
import shutil
import zlib
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TypeVar

from titanlite.config import JobConfig
from titanlite.config.fields import whole_number
from titanlite.errors import UserError
from titanlite.models.hf_files import check_hf_folder
from titanlite.tools.cache import first_cause, fsync_dir
from titanlite.tools.records import RUN_FOLDER_KINDS, folder_kind

MARKER = "complete"  # written last into a step folder: its presence means complete
CHECKSUM_MAX_BYTES = 64 * 2**20  # files up to this size get a CRC32 at save (RNG states, .metadata)

logger = logging.getLogger("titanlite")


def step_dir(folder: Path, step: int) -> Path:
    """The folder of checkpoint `step`."""
    return folder / f"step-{step:08d}"


def complete_steps(folder: Path) -> list[int]:
    """Steps of the published, complete checkpoints in `folder`, oldest first."""
    numbers = [d.name[5:] for d in folder.glob("step-*") if (d / MARKER).is_file()]
    return sorted(int(n) for n in numbers if whole_number(n))


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(2**20):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_record(path: Path) -> dict[str, list]:
    """{name: [size, CRC32 or None]} of a step folder's files but state.json and the marker,
    written after them: what damage() checks."""
    out = {}
    for f in sorted(path.iterdir()):
        if f.is_file() and f.name not in ("state.json", MARKER):
            size = f.stat().st_size
            out[f.name] = [size, _crc32(f) if size <= CHECKSUM_MAX_BYTES else None]
    return out


def publish(tmp: Path, final: Path) -> None:
    """One rename publishes the finished folder `tmp` (a step's, an export's) as `final`,
    replacing an earlier attempt's."""
    fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def damage(path: Path) -> str | None:
    """What is wrong with the complete step folder `path`, naming the file; None if it is intact."""
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as e:
        return f"state.json is unreadable ({e})"
    if whole_number(path.name[5:]) and state.get("step") != int(path.name[5:]):
        return f"state.json says step {state.get('step')}, its folder step {int(path.name[5:])}"
    if not isinstance(state.get("files"), dict):
        return "state.json records no file sizes"
    for name, (size, crc) in state["files"].items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        have = f.stat().st_size
        if have != size:
            return f"{name} holds {have:,} bytes, {size:,} were written"
        if crc is not None and _crc32(f) != crc:
            return f"{name} does not match the checksum it was written with"
    return None


def find(
    folder: Path,
    load_step: int,
    on_damaged: Callable[[Path, str], None] = lambda path, why: None,
    exclude: Collection[int] = (),
    step_flag: str = "checkpoint.load_step",
) -> int | None:
    """The step to read (None: there is none): the newest intact complete step, or `load_step`
    (>= 0), which must be one. `on_damaged(step folder, why)` hears of each damaged newer step
    passed over; `exclude`: steps to pass over (ones that failed to load)."""
    steps = [s for s in complete_steps(folder) if s not in exclude]
    newest = ", or -1 for the newest intact one" if step_flag == "checkpoint.load_step" else ""
    if load_step >= 0:
        have = ", ".join(map(str, steps)) or "none"
        if load_step not in steps:
            raise UserError(
                f"{step_flag} {load_step}: {folder} holds no complete checkpoint of that step (complete: {have}); pick one of them{newest}"
            )
        why = damage(step_dir(folder, load_step))
        if why:
            raise UserError(
                f"{step_flag} {load_step}: {step_dir(folder, load_step)} is damaged ({why}); pick another step{newest}"
            )
        return load_step
    damaged = []
    for step in reversed(steps):
        why = damage(step_dir(folder, step))
        if why is None:
            return step
        damaged.append(f"step {step}: {why}")
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


def initial_load_kind(path: Path) -> str:
    """Whether `path` is a Hugging Face model folder ("hf") or an intact step folder
    ("titanlite"); anything else is one UserError that says what to point it at."""
    flag = "checkpoint.initial_load_path"
    what = "point it at a Hugging Face model folder or a titanlite step folder (<run>/checkpoints/step-N)"
    if not path.is_dir():
        raise UserError(f"{flag} '{path}' is not a folder; {what}")
    if (path / "config.json").is_file():
        check_hf_folder(path, need_tokenizer=False)
        return "hf"
    if (path / ".metadata").is_file():
        step_to_read(path, flag=flag)  # complete and intact, or one line
        return "titanlite"
    steps = complete_steps(path)
    if steps:
        raise UserError(
            f"'{path}' is a checkpoint folder; point {flag} at one of its step folders, e.g. the "
            f"newest: '{step_dir(path, steps[-1])}'"
        )
    raise UserError(f"{flag} '{path}' holds no config.json nor a checkpoint; {what}")


def step_to_read(
    path: Path, step: int | None = None, flag: str = "RUN_DIR", exclude: Collection[int] = ()
) -> Path:
    """The intact step folder every reader (export, generation, initial weights) reads from `path`:
    a step folder itself, or a run (its checkpoint.folder) or checkpoint folder's newest intact
    step, or `step`, with one line for each damaged newer one passed over. Only reads."""
    if any((path / name).is_file() for name in (".metadata", "state.json", MARKER)):
        if step is not None:
            raise UserError(
                f"--step picks a checkpoint of a run folder, but {flag} '{path}' is a step folder already"
            )
        complete = (path / MARKER).is_file()
        why = damage(path) if complete else "its save never finished"
        if why:
            what = "damaged" if complete else "incomplete"
            raise UserError(f"{flag} '{path}' is {what} ({why}); {_intact_beside(path)}")
        return path
    folder = path
    if not complete_steps(path) and (path / "config.toml").is_file():
        from titanlite.config.manager import load_config

        folder = checkpoint_folder(load_config(str(path / "config.toml")), path)
    found = find(folder, -1 if step is None else step, _passed_over, exclude, "--step")
    if found is None:
        kind = folder_kind(path) if (path / "config.toml").is_file() else "run"
        if kind != "run":  # a rehearsal, or a run that never logged a step: said as such
            raise UserError(
                f"{flag} '{path}' is {RUN_FOLDER_KINDS[kind]}, so it holds no checkpoint; give a training "
                "run's folder or a step folder"
            )
        raise UserError(
            f"{flag} '{path}' holds no complete checkpoint (looked in '{folder}'); give a run folder that "
            "trained with checkpoint.every > 0 or checkpoint.at_end, or a step folder"
        )
    return step_dir(folder, found)


def _passed_over(path: Path, why: str, what: str = "is damaged") -> None:
    logger.warning(f"checkpoint {path} {what} ({why}); reading the newest intact one before it")


def _intact_beside(path: Path) -> str:
    folders = [step_dir(path.parent, s) for s in reversed(complete_steps(path.parent))]
    intact = [str(f) for f in folders if damage(f) is None]
    if not intact:
        return f"'{path.parent}' holds no intact checkpoint beside it"
    return "the intact ones beside it: " + ", ".join(intact[:3])


T = TypeVar("T")


def read_checkpoint(
    path: Path, read: Callable[[Path], T], step: int | None = None, flag: str = "RUN_DIR"
) -> T:
    """`read(step folder)` on the step step_to_read picks. A read that fails all the same (damage
    the sizes and checksums cannot see) counts as damage: from a run folder the next intact step
    is read instead, with one line; a step folder is refused in one line."""
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
            _passed_over(chosen, why, "failed to load")
            failed.append(int(chosen.name[5:]))


def _set_aside(path: Path, suffix: str) -> Path:
    """Rename the step folder `path` to `<name><suffix>` (the first free one), a name no reader
    takes for a step: never resumed nor pruned, and nothing is deleted."""
    target = path.with_name(path.name + suffix)
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{suffix}-{n}")
    path.rename(target)
    return target


def quarantine(path: Path, why: str, wandb: bool = False) -> None:
    """Set the damaged step folder `path` aside as `<name>.damaged`, with one line saying why."""
    target = _set_aside(path, ".damaged")
    again = "; steps after it are logged again in the same W&B run, which cannot rewind"
    logger.warning(
        f"checkpoint {path} is damaged ({why}): set aside as {target.name}; the run falls back"
        f"{again if wandb else ''}"
    )


def quarantine_damaged(folder: Path, wandb: bool = False) -> None:
    """Set aside every damaged step newer than the newest intact one, so a resume falls back to
    it (the holder of the run lock, once resume_plan found an intact step or none)."""
    find(folder, -1, lambda path, why: quarantine(path, why, wandb))


def set_aside_abandoned(folder: Path, load_step: int) -> None:
    """A rewind (checkpoint.load_step below the newest step) sets the steps after it aside as
    `<name>.abandoned`, in one line, so a later plain resume continues the new timeline."""
    steps = complete_steps(folder)
    if load_step not in steps:
        return  # no rewind (-1), or a step the preflight refuses
    newer = [s for s in steps if s > load_step]
    targets = [_set_aside(step_dir(folder, s), ".abandoned").name for s in newer]
    if targets:
        logger.warning(
            f"checkpoint: resuming from step {load_step} (checkpoint.load_step) abandons the newer step(s) "
            f"{', '.join(map(str, newer))}: set aside as {', '.join(targets)} (kept; delete them when done)"
        )
