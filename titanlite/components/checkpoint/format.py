"""What a titanlite checkpoint looks like on disk, torch-free: the marker written last into a
step folder (a folder without it never finished saving) and which kind of folder a path is. The
checkpointer writes by it, the index and the preflight read by it."""

from __future__ import annotations

from pathlib import Path

from titanlite.errors import UserError
from titanlite.models.hf_files import check_hf_folder

MARKER = "complete"
"""Written last into a checkpoint step folder (checkpointer.py): its presence means complete."""


def initial_load_kind(path: Path, flag: str = "checkpoint.initial_load_path") -> str:
    """Whether `path` is a Hugging Face model folder ("hf") or a complete checkpoint step folder
    ("titanlite"); anything else is one UserError that says what to point `flag` at."""
    what = "point it at a Hugging Face model folder or a titanlite step folder (<run>/checkpoints/step-N)"
    if not path.is_dir():
        raise UserError(f"{flag} '{path}' is not a folder; {what}")
    if (path / "config.json").is_file():
        check_hf_folder(path, need_tokenizer=False)
        return "hf"
    if (path / ".metadata").is_file():
        if not (path / MARKER).is_file() or not (path / "state.json").is_file():
            raise UserError(
                f"checkpoint '{path}' is incomplete (its save never finished); point {flag} at a "
                "complete step folder"
            )
        return "titanlite"
    steps = sorted(p for p in path.glob("step-*") if (p / MARKER).is_file())
    if steps:
        raise UserError(
            f"'{path}' is a checkpoint folder; point {flag} at one of its step folders, e.g. the "
            f"newest: '{steps[-1]}'"
        )
    raise UserError(f"{flag} '{path}' holds no config.json nor a checkpoint; {what}")
