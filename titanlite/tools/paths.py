"""What a path must be before anything uses it (the config's, every script's, the launcher's):
an existing file or folder, or one to write, with nothing in its way and a writable nearest
existing folder. Each check is one UserError naming the flag, the path and the fix."""

from __future__ import annotations

import os
from pathlib import Path

from titanlite.errors import UserError

# kind -> what the user should give, for messages
KINDS = {
    "file": "an existing file",
    "folder": "an existing folder",
    "path": "an existing file or folder",
    "out_folder": "a folder to write (new, or an existing one)",
    "new_folder": "a folder to write that does not exist yet, or an empty one",
    "out_file": "a file to write (its folder must be writable)",
}


def existing_parent(path: Path) -> Path:
    """`path` or its nearest ancestor that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def writable(folder: Path) -> bool:
    """Whether this process may create files in the existing folder `folder` (one place, so a
    test can make a folder read-only for a process that ignores permissions: root)."""
    return os.access(folder, os.W_OK | os.X_OK)


def check_writable(path: Path, flag: str) -> None:
    """`path` is a folder that exists or can be created: no file in its way, write permission."""
    base = existing_parent(path)
    if not base.is_dir():
        raise UserError(
            f"{flag} '{path}' cannot be a folder: '{base}' is a file; point {flag} elsewhere"
        )
    if not writable(base):
        raise UserError(
            f"{flag} '{path}' is not writable ('{base}' denies it); point {flag} at a writable folder"
        )


def check_path(path: Path, kind: str, flag: str) -> Path:
    """`path` as `kind` (one of KINDS) wants it, or one UserError naming `flag` and the fix."""
    want = KINDS[kind]
    if kind in ("file", "folder", "path") and not path.exists():
        raise UserError(f"{flag} '{path}' does not exist; give {want}")
    if kind in ("file", "out_file") and path.is_dir():
        raise UserError(f"{flag} '{path}' is a folder; give {want}")
    if kind in ("file", "out_file") and path.exists() and not path.is_file():  # a fifo blocks
        raise UserError(f"{flag} '{path}' is not a regular file; give {want}")
    if kind in ("folder", "out_folder", "new_folder") and path.exists() and not path.is_dir():
        raise UserError(f"{flag} '{path}' is a file; give {want}")
    if kind == "new_folder" and path.is_dir() and any(path.iterdir()):
        raise UserError(f"{flag} '{path}' is a folder that is not empty; give {want}")
    if kind in ("out_file", "out_folder", "new_folder"):
        check_writable(path.parent if kind == "out_file" else path, flag)
    return path
