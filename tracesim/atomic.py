"""Atomic file output: nothing half-written is ever visible under the final name.

Every writer in tracesim (trace store files and manifest, sweep task files and compaction,
evict outcome parts) goes through :func:`atomic_output`: write to a temporary sibling, flush and
fsync it, rename it over the target, fsync the directory. On an exception the temporary file is
removed and the target is untouched.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["TMP_SUFFIX", "atomic_output", "atomic_write_bytes", "fsync_dir", "tmp_path"]

TMP_SUFFIX = ".tmp"


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
