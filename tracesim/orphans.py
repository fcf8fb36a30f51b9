"""Worker processes exit when the driver that started them dies, even by ``kill -9``.

A sweep's local pool forks its workers from a forkserver, and a Dask LocalCluster's workers are
children of their nannies, so a worker's parent is not always the driver. The forkserver itself
outlives the driver while any worker holds the end of its "alive" pipe (every worker does), and
a worker blocked on its task queue never sees the driver go (every worker holds a write end of
that queue too), so neither the parent-death signal nor end-of-file can be relied upon alone.
:func:`watch_driver` is called once in every worker and arranges two independent exits:

- a *watchdog process* (a small ``python -c`` child of the worker, no inherited descriptors)
  checks every ``poll_s`` seconds whether the driver is still the process it was
  (``/proc/PID/stat``: gone, a zombie, or a new process under a reused pid all count as dead)
  and then kills the worker with SIGKILL. Being a separate process it works even while a
  compiled kernel or a C loop holds the worker's GIL; it exits when the worker exits;
- ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (Linux, through ``ctypes``): the kernel kills the worker
  when its parent dies, the fastest path where the parent is the driver (spawned workers).

A task killed this way leaves no result: task files are written atomically, and the driver
that would have committed them is gone anyway.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

__all__ = ["driver_alive", "process_start", "watch_driver", "watchdog_main"]

_PR_SET_PDEATHSIG = 1


def process_start(pid: int) -> str | None:
    """Start time of process ``pid`` (field 22 of ``/proc/PID/stat``); None if it is gone or a
    zombie, or where ``/proc`` does not exist (then :func:`driver_alive` asks ``kill(pid, 0)``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            text = fh.read().decode("ascii", "replace")
    except FileNotFoundError:
        return None
    except OSError:
        return "?"
    fields = text[text.rfind(")") + 2:].split()  # the name in (...) may contain spaces
    if not fields or fields[0] in ("Z", "X", "x"):
        return None
    return fields[19] if len(fields) > 19 else "?"


def driver_alive(pid: int, start: str | None) -> bool:
    """Whether ``pid`` is still the live process whose start time was ``start``."""
    if os.path.isdir("/proc/self"):
        now = process_start(pid)
        return now is not None and (start is None or now == start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _set_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - no prctl: the thread still watches
        pass


def watch_driver(driver_pid: int | None, driver_start: str | None = None,
                 poll_s: float = 0.5) -> subprocess.Popen | None:
    """Make this worker exit when the driver ``driver_pid`` dies (see the module docstring);
    returns the watchdog process.

    Parameters
    ----------
    driver_pid : int or None
        The driver's pid (``os.getpid()`` in the driver); None watches nothing.
    driver_start : str, optional
        The driver's :func:`process_start`, read in the driver, so a reused pid is not taken
        for the driver.
    poll_s : float
        Seconds between two checks of the watchdog.
    """
    if driver_pid is None:
        return None
    _set_parent_death_signal()
    if not driver_alive(driver_pid, driver_start):  # died before anything was armed
        os._exit(1)
    code = "from tracesim.orphans import watchdog_main; watchdog_main()"
    return subprocess.Popen(
        [sys.executable, "-c", code, str(driver_pid), driver_start or "", str(os.getpid()),
         repr(float(poll_s))],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True)


def watchdog_main(argv: list[str] | None = None) -> None:
    """The watchdog process: ``DRIVER_PID DRIVER_START WORKER_PID POLL_S``. Kills the worker
    (SIGKILL) once the driver is dead; exits when the worker is gone."""
    args = sys.argv[1:] if argv is None else argv
    driver, start, worker, poll_s = int(args[0]), args[1] or None, int(args[2]), float(args[3])
    worker_start = process_start(worker)
    while True:
        time.sleep(poll_s)
        if not driver_alive(worker, worker_start):
            return
        if not driver_alive(driver, start):
            try:
                os.kill(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
