"""Atomic file output: nothing half-written is ever visible under the final name.

Every writer in tracesim (trace store files and manifest, sweep task files and compaction,
evict outcome parts) goes through :func:`atomic_output`: write to a temporary sibling, flush and
fsync it, rename it over the target, fsync the directory. On an exception the temporary file is
removed and the target is untouched.

Outputs made of several files (replay, sweep results, frontier, tiers, adversary, peers) go
through :func:`atomic_files`: every file is written into a staging directory first and the set
is committed together, so a failure while writing any of them leaves every earlier file as it
was. The file listed last (the summary, which records the results' row count and sha256) is
committed last: a run killed between two renames leaves a summary that no longer matches its
results, which readers refuse (``analysis/report.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["LOCK_NAME", "STAGE_PREFIX", "TMP_SUFFIX", "DirLock", "OutputLockedError",
           "atomic_files", "atomic_output", "atomic_parquet", "atomic_write_bytes",
           "atomic_write_text", "check_file_targets", "commit_files", "fsync_dir",
           "remove_stale_tmp", "tmp_path"]

TMP_SUFFIX = ".tmp"
#: Name prefix of the staging directories of :func:`atomic_files` (they end in TMP_SUFFIX).
STAGE_PREFIX = ".stage."
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


def check_file_targets(directory: str | os.PathLike, names: list[str]) -> None:
    """Refuse, before anything is written, a target that is not a regular file or absent.

    A directory (or a symlink, a FIFO) named like an output file cannot be replaced by a
    rename; finding out after the first file of a set was replaced would half-commit it.

    Raises
    ------
    tracesim.errors.UsageError
        Naming the path and what is in the way.
    """
    from tracesim.errors import UsageError

    for name in names:
        target = Path(directory) / name
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            continue
        kind = ("a symlink" if stat.S_ISLNK(st.st_mode) else "a directory"
                if stat.S_ISDIR(st.st_mode) else "not a regular file")
        raise UsageError(f"{target}: is {kind}, expected a regular file (or nothing) there "
                         "for this output file; move it away (nothing was written)")


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_files(stage: Path, directory: Path, names: list[str]) -> None:
    """Move ``stage/<name>`` over ``directory/<name>`` for every name, as one unit.

    The targets are checked first (:func:`check_file_targets`); each existing target is
    hard-linked into the stage before it is replaced, so an error in the middle of the swap
    rolls every replaced file back and removes the new ones: the earlier set stays
    byte-identical. Names are committed in order: list the summary last.
    """
    check_file_targets(directory, names)
    for name in names:
        _fsync_file(stage / name)
    old = stage / ".old"
    old.mkdir()
    done: list[tuple[str, bool]] = []  # (name, had an earlier file)
    try:
        for name in names:
            target = directory / name
            had = target.exists()
            if had:
                try:
                    os.link(target, old / name)
                except OSError:  # no hard links on this file system: keep a copy
                    shutil.copy2(target, old / name)
            os.replace(stage / name, target)
            done.append((name, had))
    except BaseException:
        for name, had in reversed(done):
            if had:
                os.replace(old / name, directory / name)
            else:
                (directory / name).unlink(missing_ok=True)
        fsync_dir(directory)
        raise
    fsync_dir(directory)


@contextlib.contextmanager
def atomic_files(directory: str | os.PathLike, names: list[str]) -> Iterator[Path]:
    """A staging directory whose files ``names`` replace those in ``directory`` together.

    Write every file of the set into the yielded directory; when the block completes they are
    committed by :func:`commit_files` (the last name last). On an exception in the block, or
    a refused target, nothing in ``directory`` changes. The stage lies inside ``directory``
    (same file system, so renames are atomic) and is removed in every case; a killed run's
    stage is removed by :func:`remove_stale_tmp`.

    Examples
    --------
    >>> with atomic_files(out, ["replay.parquet", "summary.json"]) as stage:  # doctest: +SKIP
    ...     write(stage / "replay.parquet"); write(stage / "summary.json")
    """
    directory = Path(directory)
    check_file_targets(directory, names)
    stage = directory / f"{STAGE_PREFIX}{os.getpid()}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"
    stage.mkdir()
    try:
        yield stage
        missing = [n for n in names if not (stage / n).is_file()]
        if missing:
            raise RuntimeError(f"atomic_files: {missing} were not written into the stage")
        commit_files(stage, directory, names)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


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
    for stale in list(found):
        if stale.is_symlink():
            continue
        if stale.is_file():
            stale.unlink(missing_ok=True)
            n += 1
        elif stale.is_dir() and stale.name.startswith(STAGE_PREFIX):  # atomic_files' stage
            shutil.rmtree(stale, ignore_errors=True)
            n += 1
    return n
