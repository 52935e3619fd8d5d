"""One owner per run directory: an OS file lock on ``<run>/run.lock``, held for the run's life.

Two runs writing one directory interleave their metrics rows and checkpoints (issue 41,
finding 2). The lock is ``fcntl.flock``: the kernel releases it when its owner's process ends,
however it ends (exit, exception, SIGKILL), so a dead owner's lock file never blocks the next
run; no stale-lock heuristics (pid probing, timestamps) are needed. The file holds the owner's
host and pid, so a refused run can say whose the directory is.

The lock file is created in the run directory, so taking it may create the directory; a run
refused before it wrote anything (``release(remove_if_created=True)``) removes the directory
(and a missing ``out_dir`` it made) again when it holds nothing but the lock.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from pathlib import Path

from diffrl.errors import DiffrlError

log = logging.getLogger(__name__)
LOCK_NAME = "run.lock"


class RunDirLocked(DiffrlError):
    """Another live process owns the run directory."""


class RunLock:
    """``flock`` on ``root/run.lock``; ``acquire`` refuses at once (no waiting) when another
    process holds it."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.path = self.root / LOCK_NAME
        self.fd: int | None = None
        # the directories this lock made (the run directory, and out_dir where it was missing),
        # deepest first: a run refused before writing removes those it left empty
        self.created: list[Path] = []

    def acquire(self) -> RunLock:
        missing = self.root
        while not missing.exists() and missing.parent != missing:
            self.created.append(missing)
            missing = missing.parent
        self.root.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirLocked(
                    f"run directory {self.root} is in use by {owner(self.path)}; wait for that "
                    "run to end or stop it, or give this one another run.name / run.out_dir"
                ) from None
            except OSError as e:  # a filesystem without locks (some network mounts)
                os.close(fd)
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                log.warning("%s: no file locks here (%s): two runs could share it", self.path, e)
                return self
            # the file we locked must still be the one at the path: a run that removed its
            # directory (``release``) between our open and our flock leaves us an orphan inode
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
            self.root.mkdir(parents=True, exist_ok=True)
        self.fd = fd
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        os.ftruncate(fd, 0)
        os.pwrite(
            fd, f"pid {os.getpid()} on host {socket.gethostname()} since {stamp}\n".encode(), 0
        )
        return self

    def release(self, remove_if_created: bool = False) -> None:
        """Unlock. With ``remove_if_created``, a run directory this lock created and that holds
        nothing else is removed (a run refused before writing leaves no directory behind)."""
        if self.fd is None:
            return
        if remove_if_created and self.created:
            try:
                if [p.name for p in self.root.iterdir()] == [LOCK_NAME]:
                    self.path.unlink()  # while still locked: no one else can be using it
                    for d in self.created:
                        d.rmdir()  # OSError when another run has put something there: kept
            except OSError as e:
                log.info("left %s in place: %s", e.filename, e.strerror)
        os.close(self.fd)  # closing the descriptor drops the flock
        self.fd = None


def owner(path: Path) -> str:
    """What the lock file says of its holder: 'pid N on host H since T'."""
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    return text or "another process (it has not written its pid yet)"
