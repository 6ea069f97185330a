"""The one writer of a run folder's records (rank 0). A record is written whole or not at all: a
failed append (a full disk) is cut back, and the run stops (exit 3) in one line naming the disk
and what was kept. A file removed under the live run (appends to an unlinked file are lost) is
written again; one replaced by a folder, or the run folder gone, stops the run."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from titanlite.components.checkpoint.index import complete_steps
from titanlite.errors import TrainingError, first_line
from titanlite.tools.cache import atomic_write_bytes, disk_full

logger = logging.getLogger("titanlite")

RECORD_FILES = ("metrics.jsonl", "diagnostics.jsonl", "events.jsonl", "eval.jsonl", "samples.jsonl")


class RunFiles:
    """Rank 0's appends to the run folder's record files. `fail_write(name)` (a test seam:
    titanlite.faults's write_error) is the OSError a write of file `name` ("tb": TensorBoard's
    events) meets instead of the disk, or None."""

    def __init__(self, run_dir: Path, checkpoints: Path | None = None) -> None:
        self.run_dir, self.checkpoints = run_dir, checkpoints
        self.fail_write: Callable[[str], OSError | None] | None = None
        self._fds: dict[str, int] = {}
        self.kept: dict[str, int] = {}  # file -> the last step whose records it holds

    def append(self, name: str, records: Iterable[dict[str, Any]]) -> None:
        """Whole records, one line each, or none of them (a TrainingError says why)."""
        records = list(records)
        if not records:
            return
        data = "".join(json.dumps(r) + "\n" for r in records).encode()
        fd = self._fd(name)
        end = os.fstat(fd).st_size
        try:
            error = self.fail_write(name) if self.fail_write else None
            if error is not None:  # as a disk that fills mid-record would: half of it lands
                os.write(fd, data[: len(data) // 2])
                raise error
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError as e:
            os.ftruncate(fd, end)  # no half record; shrinking a file needs no room
            raise TrainingError(self.failed(e, f"writing {self.run_dir / name}")) from None
        self.kept[name] = max(r.get("step", 0) for r in records)

    def check(self) -> None:
        """As the run starts, each file created (empty: a reader finds each from the start); every
        log step, each still where it was written (one removed is written again)."""
        for name in RECORD_FILES:
            self._fd(name)

    def _fd(self, name: str) -> int:
        """The open file of `name`, opened anew if it was removed."""
        path = self.run_dir / name
        fd = self._fds.get(name)
        try:
            here = os.stat(path)
        except FileNotFoundError:
            here = None
        except OSError as e:
            raise TrainingError(self.failed(e, f"writing {path}")) from None
        if fd is not None and here is not None and os.path.samestat(here, os.fstat(fd)):
            return fd
        if here is not None and stat.S_ISDIR(here.st_mode):
            raise TrainingError(
                f"{path} is a folder now (something replaced the run's file while it ran); "
                + self.what_was_kept(f"move that folder away from {path}")
            )
        if not self.run_dir.is_dir():
            raise TrainingError(self.gone())
        if fd is not None:
            os.close(fd)
            logger.warning(
                f"{path} was removed or replaced while the run wrote to it; writing it again from here"
            )
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as e:
            raise TrainingError(self.failed(e, f"writing {path}")) from None
        self._fds[name] = fd
        return fd

    def failed(self, e: BaseException, what: str, fix: str = "mend that") -> str:
        """The stop line of a write into the run folder that failed (`what`: "writing <file>"):
        the disk, what was kept, how to go on."""
        where = f"'{self.run_dir}'"
        full = disk_full(e, self.run_dir)
        why, fix = {
            errno.ENOSPC: (full or f"disk full under {where}", "make room"),
            errno.EDQUOT: (f"the disk quota under {where} is used up", "make room"),
            errno.EROFS: (f"the disk under {where} is read-only", "make it writable"),
            errno.EFBIG: ("the file is larger than its file system allows", "make room"),
        }.get(getattr(e, "errno", None), (full or first_line(e), fix))
        return f"{what} failed: {why}; {self.what_was_kept(fix)}"

    def gone(self) -> str:
        """The stop line of a run folder moved (an open file says where, in /proc) or removed."""
        for fd in self._fds.values():
            try:
                now = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if not now.endswith(" (deleted)"):
                moved = Path(now).parent
                checkpoints = self.checkpoints
                if checkpoints is not None and checkpoints.is_relative_to(self.run_dir):
                    checkpoints = moved / checkpoints.relative_to(self.run_dir)
                kept = self.what_was_kept(f"move it back to {self.run_dir}", checkpoints)
                return f"the run folder {self.run_dir} was moved to {moved} while the run wrote to it; {kept}"
        return f"the run folder {self.run_dir} was removed while the run wrote to it; stopped, as its records and checkpoints went with it"

    def what_was_kept(self, fix: str = "mend that", checkpoints: Path | None = None) -> str:
        """The rest of the stop line: what the run leaves (in `checkpoints`, if not where they were
        written), and how to go on."""
        records = "the records written are whole"
        if step := self.kept.get("metrics.jsonl"):
            records = f"its records up to step {step} are whole"
        checkpoints = checkpoints or self.checkpoints
        steps = complete_steps(checkpoints) if checkpoints is not None else []
        saved = ", and it has no checkpoint"
        if steps:
            saved = f", its newest checkpoint is step {steps[-1]}"
        return f"the run stopped: {records}{saved}; {fix}, then rerun the same command to resume"

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def truncate_after(run_dir: Path, step: int) -> None:
    """A resumed run continues from `step`: drop the records of later steps (written before the
    crash) from the JSONL files, and a line cut off by the crash; each file rewritten atomically."""
    for name in RECORD_FILES:
        path = run_dir / name
        if not path.is_file():
            continue
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("step", 0) <= step:
                kept.append(line + "\n")
        atomic_write_bytes(path, "".join(kept).encode())
