"""One live run per run folder: `<run>/run.lock` names its holder (host, pid, start time), which
keeps a flock on it that the kernel drops however the process dies; the file removed under the
live run is made again within a second. Where flock does not reach across hosts, the holder
touches it every REFRESH_S, and another host's lock untouched for STALE_S is dead (taken over
with a warning). The launcher holds it (torchrun's restarts stay inside one run), else rank 0."""

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
        """Take the lock (once), or raise a UserError naming the live holder. The folder must exist."""
        if self._fd is not None:
            return
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            holder = self._refuse_if_live(fd, fcntl.LOCK_EX)
            if _same_file(fd, self.path):
                break
            os.close(fd)  # its holder released (unlinked) it between our open and our flock
        if holder:
            logger.warning(
                f"run folder {self.run_dir}: taking over the stale lock of host {holder.get('host')} pid {holder.get('pid')} (started {holder.get('started')}); that process is gone"
            )
        started = datetime.now().isoformat(timespec="seconds")
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": started}
        self._me = (json.dumps(me) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, self._me, 0)
        self._fd = fd
        threading.Thread(target=self._heartbeat, name="run-lock", daemon=True).start()

    def refuse_if_held(self) -> None:
        """Raise acquire's refusal if a live run holds the lock, taking nothing (the preflight)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        self._refuse_if_live(fd, fcntl.LOCK_SH)
        os.close(fd)  # drops the probe's shared flock

    def _refuse_if_live(self, fd: int, how: int) -> dict:
        """The holder the file names, once `fd` is flocked (`how`); a live one (its flock held, or
        another host's lock touched within STALE_S) closes `fd` and raises the refusal."""
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            held = False
        except BlockingIOError:
            held = True
        try:
            holder = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            holder = {}
        if holder and holder.get("host") != socket.gethostname():
            held = held or time.time() - os.fstat(fd).st_mtime < STALE_S
        if not held:
            return holder
        os.close(fd)
        who = f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {holder.get('started', '?')}"
        raise UserError(
            f"run folder '{self.run_dir}' is in use by a live run ({who}); wait for it or stop it, or pick another --job.run_name"
        )

    def _heartbeat(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(WATCH_S):
            with contextlib.suppress(OSError), self._mutex:
                if self._fd is not None and not _same_file(self._fd, self.path):  # not released
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
                f"run folder {self.run_dir}: its run.lock was removed and another launch took it; two runs now write this folder: stop one of them"
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
