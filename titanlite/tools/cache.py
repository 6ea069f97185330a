"""The cache folder and atomic writes, so an interrupted build never leaves a half file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir(configured: str) -> Path:
    raw = configured or os.environ.get("TITANLITE_CACHE") or "~/.cache/titanlite"
    path = Path(raw).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a rename into it, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
