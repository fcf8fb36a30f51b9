"""Atomic file output: nothing half-written is ever visible under the final name.

Every writer in tracesim (trace store files and manifest, sweep task files and compaction,
evict outcome parts) goes through :func:`atomic_output`: write to a temporary sibling, flush and
fsync it, rename it over the target, fsync the directory. On an exception the temporary file is
removed and the target is untouched.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["LOCK_NAME", "TMP_SUFFIX", "DirLock", "OutputLockedError", "atomic_output",
           "atomic_parquet", "atomic_write_bytes", "atomic_write_text", "fsync_dir",
           "remove_stale_tmp", "tmp_path"]

TMP_SUFFIX = ".tmp"
#: Lock file every output writer (replay, sweep, evict, report) holds in its output directory.
LOCK_NAME = ".tracesim.lock"


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (after a rename); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def tmp_path(path: Path) -> Path:
    """Temporary sibling of ``path`` used while writing it."""
    path = Path(path)
    return path.with_name(path.name + TMP_SUFFIX)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, *, unique: bool = False) -> Iterator[BinaryIO]:
    """Open a binary file that appears at ``path`` only once the block completes.

    With ``unique`` the temporary name also carries the process id and a random suffix, for
    writers that may race on the same target (a retried task while a lost worker still runs);
    the last complete file wins and no one ever sees a partial one.
    """
    path = Path(path)
    tmp = (path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
           if unique else tmp_path(path))
    try:
        with open(tmp, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, unique: bool = False) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_output(path, unique=unique) as fh:
        fh.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically (unique temp name)."""
    atomic_write_bytes(path, text.encode("utf-8"), unique=True)


@contextlib.contextmanager
def atomic_parquet(path: str | os.PathLike, schema, **kwargs) -> Iterator:
    """A ``pyarrow.parquet.ParquetWriter`` whose file appears at ``path`` only when the block
    completes; on an exception (or a kill) nothing that looks like a result is left."""
    import pyarrow.parquet as pq

    with atomic_output(path, unique=True) as fh, pq.ParquetWriter(fh, schema, **kwargs) as w:
        yield w


class OutputLockedError(ValueError):
    """Another process writes the same output directory (a user error: exit 2)."""


class DirLock:
    """Exclusive, non-blocking ``flock`` on ``<directory>/.tracesim.lock``.

    Held for the whole run by every writer of an output directory (replay, sweep, evict,
    report), so a second concurrent writer is refused with :class:`OutputLockedError` instead
    of interleaving files. The kernel drops the lock when the process dies, so a killed run
    never leaves a stale lock. While it is held, leftover temporary files in the directory
    belong to dead runs and may be removed (:func:`remove_stale_tmp`).
    """

    def __init__(self, directory: str | os.PathLike, what: str = "tracesim") -> None:
        self.directory = Path(directory)
        self.fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise OutputLockedError(
                f"{self.directory}: another {what} run is writing this output directory "
                f"(lock {LOCK_NAME} is held), expected exclusive use; wait for it or choose "
                "another --out") from None

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def remove_stale_tmp(directory: str | os.PathLike, recursive: bool = False) -> int:
    """Remove temporary files (``*.tmp``) of dead runs; call only while holding the
    :class:`DirLock` of ``directory``. Returns the number removed."""
    root = Path(directory)
    if not root.is_dir():
        return 0
    found = root.rglob("*" + TMP_SUFFIX) if recursive else root.glob("*" + TMP_SUFFIX)
    n = 0
    for stale in found:
        if stale.is_file() and not stale.is_symlink():
            stale.unlink(missing_ok=True)
            n += 1
    return n
