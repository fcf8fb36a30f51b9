"""What ties an output to its inputs: file hashes, the pre-registration, source digests, and
file names that identify the id they were made from.

Every record tracesim writes names its inputs by the same hash format, ``sha256:<hex>`` of the
file's bytes (:func:`sha256_file`): store checksums in ``manifest.parquet`` and ``model.json``,
``results_sha256`` in summaries, the pre-registration's hash (:func:`prereg_sha256`) that the
report compares before it prints a verdict. Files are read through
:func:`tracesim.safeio.hash_file`, so a FIFO, device or /proc file is refused instead of being
read forever.

:func:`safe_file_stem` turns an arbitrary id (a sequence id, a store label) into a file stem
that is safe on every file system and cannot collide with another id's. Each caller keeps the
parameters its files were first written with, so the names of existing stores, sweep task
files and in-loop parts stay the same.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path

from tracesim.errors import UsageError
from tracesim.safeio import MAX_HASH_BYTES, hash_file

__all__ = ["ASCII_UNSAFE", "PREREG_FILE", "find_prereg", "prereg_record", "prereg_sha256",
           "safe_file_stem", "sha256_file", "source_digest"]

#: Where a pre-registration is looked for, relative to a directory and its parents.
PREREG_FILE = Path("data") / "prereg.yaml"
#: Characters that are not safe in a file name on every file system (replaced by ``_``).
ASCII_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


# --------------------------------------------------------------------------- file hashes


def sha256_file(path: str | os.PathLike, what: str = "file", *, limit: int | None = None,
                error: type[Exception] = UsageError) -> str:
    """``sha256:<hex>`` of the bytes of a regular file, read in 1 MiB blocks.

    Parameters
    ----------
    path : path
        The file.
    what : str
        What the file is, for error messages (``"store file"``, ``"results file"``).
    limit : int, optional
        Largest size accepted, in bytes; None: no limit (the file is read in blocks, so memory
        stays bounded either way).
    error : exception type
        Raised, naming ``path`` and ``what``, for a file that is not a readable regular file
        (FIFO, device, /proc) or exceeds ``limit``.
    """
    return hash_file(path, limit=limit, what=what, error=error)


def prereg_sha256(path: str | os.PathLike) -> str:
    """``sha256:<hex>`` of a pre-registration file (what results summaries record), at most
    :data:`tracesim.safeio.MAX_HASH_BYTES` bytes."""
    return sha256_file(path, "pre-registration file", limit=MAX_HASH_BYTES)


def source_digest(root: Path, files: Iterable[Path]) -> str:
    """Hex sha256 of source files, in the order given: for each, its path relative to
    ``root`` (POSIX form), NUL, its bytes, NUL. The path is part of the digest, so moving code
    between files changes it."""
    h = hashlib.sha256()
    for path in files:
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


# --------------------------------------------------------------------------- pre-registration


def find_prereg(explicit: Path | None, near: str) -> Path | None:
    """The pre-registration file: ``explicit`` if given, else :data:`PREREG_FILE` found in the
    current directory or in the directory of ``near`` (a spec file, a trace store; ``"<dict>"``
    for a spec given as a dict) or one of its parents (the repo root); None if there is none."""
    if explicit is not None:
        return explicit
    places = [Path.cwd()]
    src = Path(near)
    if near != "<dict>" and src.exists():
        places += [src.resolve().parent, *src.resolve().parent.parents]
    for place in places:
        candidate = place / PREREG_FILE
        if candidate.is_file():
            return candidate.resolve()
    return None


def prereg_record(explicit: Path | None, near: str) -> dict[str, str] | None:
    """The ``prereg`` entry of a summary, ``{"path": ..., "sha256": ...}``, of the file
    :func:`find_prereg` finds; None if there is none.

    Callers compute it before any work, so a pre-registration that cannot be read (a FIFO, a
    /proc file) fails the run at once rather than after hours.
    """
    path = find_prereg(explicit, near)
    return None if path is None else {"path": str(path), "sha256": prereg_sha256(path)}


# --------------------------------------------------------------------------- file names


def safe_file_stem(name: str, *, max_chars: int, digest_chars: int,
                   unsafe: re.Pattern[str] = ASCII_UNSAFE, strip_leading_dots: bool = False,
                   always_digest: bool = False) -> str:
    """A file stem for ``name`` that is safe and cannot collide with another name's.

    Every match of ``unsafe`` becomes ``_`` (with ``strip_leading_dots``, leading dots are then
    removed, and an empty result becomes ``_``). A stem that differs from ``name`` or is
    longer than ``max_chars`` (or every stem, with ``always_digest``) is cut to ``max_chars``
    characters and gets ``-`` and the first ``digest_chars`` hex digits of the sha256 of
    ``name`` appended: two names that sanitize alike still get different files, and a name
    that is already safe maps to itself.

    Parameters
    ----------
    name : str
        The id to name a file after.
    max_chars : int
        Longest stem kept before the digest, in characters.
    digest_chars : int
        Hex digits of the digest appended.
    unsafe : compiled pattern
        What to replace; :data:`ASCII_UNSAFE` by default.
    strip_leading_dots : bool
        Remove leading dots after replacing (no hidden files, no ``.``/``..``).
    always_digest : bool
        Append the digest to every stem, safe or not.
    """
    stem = unsafe.sub("_", name)
    if strip_leading_dots:
        stem = stem.lstrip(".") or "_"
    if always_digest or stem != name or len(stem) > max_chars:
        stem = f"{stem[:max_chars]}-{hashlib.sha256(name.encode()).hexdigest()[:digest_chars]}"
    return stem
