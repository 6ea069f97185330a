"""The cache folder and atomic writes, so an interrupted build never leaves a half file; and
telling a full disk from other write failures."""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

# Under this much left after a failed write, the disk is taken as full: numpy's tofile and
# torch.save's zip writer report a short write with no errno ("unexpected pos 704 vs 598").
LOW_SPACE = 64 << 20


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


@contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A file written under a temporary name in the same folder, synced and renamed over `path`
    as the block ends (removed if it raises): never a half file. It gets the mode the user's umask
    gives (created 0666 & ~umask, as open() would), not mkstemp's 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """`data` as the whole of `path`, through atomic_file."""
    with atomic_file(path) as f:
        f.write(data)


def _no_space_errno(e: BaseException) -> bool:
    """ENOSPC anywhere in `e`: its causes, or the per-rank failures DCP gathers."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if isinstance(x, tuple):  # DCP's (exception, traceback)
            x = x[0]
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno == errno.ENOSPC:
            return True
        todo += [x.__cause__, x.__context__, *(getattr(x, "failures", None) or {}).values()]
    return False


def disk_full(e: BaseException, folder: Path) -> str | None:
    """ "disk full under '<folder>' (<space> left)" when the write that raised `e` ran out of space
    (ENOSPC, or under LOW_SPACE left after it), else None."""
    try:
        free: int | None = shutil.disk_usage(folder).free
    except OSError:
        free = None
    if not _no_space_errno(e) and (free is None or free >= LOW_SPACE):
        return None
    left = "?"
    if free is not None:
        left = f"{free / 2**30:.1f} GiB" if free >= 2**30 else f"{free / 2**20:.1f} MiB"
    return f"disk full under '{folder}' ({left} left)"


def first_cause(e: BaseException) -> str:
    """One line: DCP's CheckpointException wraps each failed rank's exception."""
    failures = getattr(e, "failures", None)
    if failures:
        rank, inner = next(iter(failures.items()))
        inner = inner[0] if isinstance(inner, tuple) else inner  # (exception, traceback)
        return f"rank {rank}: {type(inner).__name__}: {inner}"
    return f"{type(e).__name__}: {e}".splitlines()[0]
