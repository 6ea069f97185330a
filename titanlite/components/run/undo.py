"""A launch that stops before it has anything to keep leaves an existing run folder as it found
it: the files a rehearsal rewrites as it starts (config.toml, run.json, rehearsal.json) go back
to what they held, and the files it added go, so a stop line that says nothing was written or
kept is true of a folder an earlier rehearsal of the same name left too."""

from __future__ import annotations

import contextlib
from pathlib import Path

from titanlite.components.run.lock import LOCK_NAME


class FolderSnapshot:
    """Every file under `folder` (its run lock aside) and what it held, taken before a launch."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files = {p: p.read_bytes() for p in self._files()}
        self.folders = {d for d in folder.rglob("*") if d.is_dir()} if folder.is_dir() else set()

    def _files(self) -> list[Path]:
        found = self.folder.rglob("*") if self.folder.is_dir() else []
        return [p for p in found if p.is_file() and p.name != LOCK_NAME]

    def restore(self) -> None:
        """The folder as it was: files added since removed, files changed written back."""
        for p in self._files():
            if p not in self.files:
                p.unlink(missing_ok=True)
        for p, data in self.files.items():
            if not p.is_file() or p.read_bytes() != data:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data)
        added = {d for d in self.folder.rglob("*") if d.is_dir()} - self.folders
        for d in sorted(added, reverse=True):  # the deepest first; one that holds a file stays
            with contextlib.suppress(OSError):
                d.rmdir()
