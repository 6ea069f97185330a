"""One live run per run folder: `<run>/run.lock` names its holder (host, pid, start time).

The holder keeps an exclusive flock on the file for its whole life, which the kernel drops when
the process dies however it dies, so on one host a lock whose process is gone is stale by
construction. A lock file removed under the live run (by hand, by a cleanup script) is made
again within a second, so a second launch still finds the folder in use. A file system whose flock does not reach across hosts is covered by a heartbeat:
the holder touches the file every REFRESH_S, and another host's lock untouched for STALE_S is
taken to be dead. A stale lock is taken over with a warning.

The launcher holds it (so torchrun's restarts of the worker group stay inside one run); without
the launcher, rank 0 of the workers does.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
from datetime import datetime
from pathlib import Path

from titanlite.errors import UserError

logger = logging.getLogger("titanlite")

LOCK_NAME = "run.lock"
REFRESH_S = 30.0
STALE_S = 120.0
WATCH_S = 1.0  # how often the holder checks that its lock file is still there
HELD_ENV = "TITANLITE_RUN_LOCK"  # set by the launcher for its workers: the lock it holds


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / LOCK_NAME
        self._fd: int | None = None
        self._stop = threading.Event()
        self._mutex = threading.Lock()  # the heartbeat's remake against release

    def acquire(self) -> None:
        """Take the lock, or raise a UserError naming the live holder. The run folder must exist."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise UserError(self._refusal(self._holder())) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # its holder released (unlinked) it between our open and our flock
        holder = self._holder()
        if _other_host_alive(holder, fd):
            os.close(fd)
            raise UserError(self._refusal(holder))
        if holder:
            logger.warning(
                f"run folder {self.run_dir}: taking over the stale lock of host {holder.get('host')} pid "
                f"{holder.get('pid')} (started {holder.get('started')}); that process is gone"
            )
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.now().isoformat(timespec="seconds"),
        }
        self._me = (json.dumps(me) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, self._me, 0)
        self._fd = fd
        threading.Thread(target=self._heartbeat, name="run-lock", daemon=True).start()

    def refuse_if_held(self) -> None:
        """Raise acquire's refusal if a live run holds the lock, taking nothing: a check that
        looks at the folder without running in it (the standalone preflight)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UserError(self._refusal(self._holder())) from None
            holder = self._holder()
            if _other_host_alive(holder, fd):
                raise UserError(self._refusal(holder))
        finally:
            os.close(fd)  # drops the probe's shared flock

    def _holder(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def _refusal(self, holder: dict) -> str:
        who = f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {holder.get('started', '?')}"
        return (
            f"run folder '{self.run_dir}' is in use by a live run ({who}); wait for it or stop it, "
            "or pick another --job.run_name"
        )

    def _heartbeat(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(WATCH_S):
            with contextlib.suppress(OSError), self._mutex:
                if (
                    self._fd is not None
                    and not self._stop.is_set()
                    and not _same_file(self._fd, self.path)
                ):
                    self._remake()
                if time.monotonic() - last >= REFRESH_S:
                    os.utime(self.path)
                    last = time.monotonic()

    def _remake(self) -> None:
        """The lock file was removed under the live run: make it again, held."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            logger.warning(
                f"run folder {self.run_dir}: its run.lock was removed and another launch took it; two runs now "
                "write this folder: stop one of them"
            )
            return
        os.pwrite(fd, self._me, 0)
        os.close(self._fd)
        self._fd = fd

    def release(self) -> None:
        with self._mutex:
            if self._fd is None:
                return
            self._stop.set()
            with contextlib.suppress(OSError):
                self.path.unlink()
            os.close(self._fd)  # drops the flock
            self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _other_host_alive(holder: dict, fd: int) -> bool:
    """The lock names another host and was touched within STALE_S: a live holder whose flock
    this file system may not show."""
    other = bool(holder) and holder.get("host") != socket.gethostname()
    return other and time.time() - os.fstat(fd).st_mtime < STALE_S
