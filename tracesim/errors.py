"""User errors and small argument checks shared by every subcommand.

A :class:`UsageError` (or any ``ValueError``, :class:`~tracesim.store.StoreError`,
:class:`~tracesim.policies.grid.SpecError`) raised by a subcommand is printed by ``tracesim`` as one
line and exits with status 2; a traceback is shown only with ``tracesim --debug``.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["MAX_THREADS", "UsageError", "check_int", "check_out_dir", "check_threads",
           "describe_os_error"]

#: Upper bound of every ``--threads``-like option (numba refuses more than its pool anyway).
MAX_THREADS = 1024


class UsageError(ValueError):
    """A user error: the message names the file or option, the field and the expected value."""


def check_int(value: int | None, option: str, lo: int, hi: int | None = None) -> None:
    """Raise :class:`UsageError` unless ``value`` is None or an int in ``[lo, hi]``."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (
            hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise UsageError(f"{option} is {value!r}, expected an int {rng}")


def check_threads(value: int | None, option: str = "--threads") -> None:
    """``value`` must be None or in ``[1, min(MAX_THREADS, numba's pool size)]``."""
    if value is None:
        return
    hi = MAX_THREADS
    try:
        from numba import config

        hi = min(hi, int(config.NUMBA_NUM_THREADS))
    except Exception:  # pragma: no cover - numba is a hard dependency
        pass
    check_int(value, option, 1, hi)


def check_out_dir(path: str | os.PathLike, option: str = "--out") -> Path:
    """An output directory that exists or can be created, and is writable.

    Nothing is created; raises :class:`UsageError` naming ``option`` otherwise.
    """
    out = Path(path)
    probe = out
    while not probe.exists():
        if probe.is_symlink():
            raise UsageError(f"{option} {out}: {probe} is a dangling symlink, expected a "
                             "directory")
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"{option} {out}: {probe} is not a directory, expected a directory "
                         "(or a path that can be created)")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {out}: {probe} is not writable, expected a writable "
                         "directory")
    return out


def describe_os_error(exc: OSError) -> str:
    """One line for an ``OSError`` reaching the user (disk full gets its own wording)."""
    where = exc.filename if exc.filename is not None else "output"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"{where}: disk full (no space left on the device), expected free space; "
                "completed outputs are intact, free some space and rerun the same command to "
                "resume")
    reason = exc.strerror or str(exc)
    return f"{where}: {reason}"
