"""Writing files so that a full disk or a file-size limit is one clear line, never a torn file.

A run writes checkpoints, ``metrics.jsonl``, ``config.yaml``, sample grids and ``curves.png``.
When the disk fills (``ENOSPC``, or ``EDQUOT`` past a quota) or a file passes the process's
file-size limit (``EFBIG``: ``ulimit -f``, with ``SIGXFSZ`` ignored as Python does), the write
raises ``DiskError``, a one-line message naming the path, the bytes the write needed and the
space there was, and the CLI exits with status 2. Artefacts are rendered in memory and written
beside their path, then renamed over it (``write_atomic``), so a failed write leaves the old
file whole (or none) rather than a truncated PNG.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from diffrl.errors import DiffrlError

# no room on the device, over a quota, or over the file-size limit: each a fact about the
# machine, not a bug, so each is a one-line error rather than a traceback
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class DiskError(DiffrlError):
    """A write failed for lack of space (or over the file-size limit); the message names the
    path and the space needed."""


def sized(n: float) -> str:
    """Bytes for people: 812 B, 4.0 KiB, 1.50 GiB."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if n < 100 else f"{n:.0f} {unit}"
    raise AssertionError("unreachable")


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem that holds ``path`` (its nearest existing ancestor)."""
    here = Path(path).absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    try:
        return shutil.disk_usage(here).free
    except OSError:
        return None


def file_size_limit() -> int | None:
    """This process's file-size limit in bytes (``ulimit -f``), None when unlimited/unknown."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def describe(e: OSError, path: Path, need: int, at_least: bool = False) -> str:
    """The one line for a disk error ``e`` while writing ``need`` bytes to ``path`` (more
    than ``need`` with ``at_least``: a streamed file whose size is known only up to the
    failure)."""
    if e.errno == errno.EFBIG:
        limit = file_size_limit()
        why = f"over the file-size limit ({sized(limit)}, ulimit -f)" if limit else "too large"
        fix = "raise the limit"
    else:
        free = free_bytes(path)
        what = "no space left" if e.errno == errno.ENOSPC else "over the disk quota"
        why = f"{what} ({sized(free)} free there)" if free is not None else what
        fix = "free some space or point run.out_dir at a larger disk"
    need_s = f"more than {sized(need)}" if at_least else sized(need)
    return (
        f"cannot write {path}: it needs {need_s}, {why}; {fix}, then run the same command "
        "again (a run resumes from its newest checkpoint)"
    )


def disk_message(e: OSError) -> str:
    """The one line for a disk error that reached the CLI unwrapped: the size of the write
    is not known there, the path is where the OS names it."""
    where = e.filename or "a file"
    return (
        f"cannot write {where}: {e.strerror}; free some space (or raise ulimit -f) and run "
        "the same command again"
    )


@contextmanager
def disk_errors(path: Path, need: int) -> Iterator[None]:
    """Turn a disk-full / file-too-large ``OSError`` in the block into ``DiskError``."""
    try:
        yield
    except OSError as e:
        if e.errno not in DISK_ERRNOS:
            raise
        raise DiskError(describe(e, Path(path), need)) from None


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; when the block ends it is fsynced and moved
    over ``path``; if the block raises it is removed and ``path`` is left as it was (a disk
    error raised as ``DiskError``, with the bytes written so far as the least needed)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        try:
            yield tmp
            with tmp.open("rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            if e.errno not in DISK_ERRNOS:
                raise
            written = tmp.stat().st_size if tmp.exists() else 0
            raise DiskError(describe(e, path, written, at_least=True)) from None
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: Path, data: bytes) -> Path:
    """``data`` to ``path`` whole or not at all: written beside it, fsynced, renamed over it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with disk_errors(path, len(data)):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def append_durably(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path`` and fsync; on a disk error the file is cut back to its old
    end, so a reader never meets half a row."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        try:
            with disk_errors(path, len(data)):
                write_all(fd, data)
                os.fsync(fd)
        except DiskError:
            os.ftruncate(fd, end)
            raise
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """Every byte of ``data`` to ``fd``: a write may take part of them before the disk fills,
    and only the next one raises."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
