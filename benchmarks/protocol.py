"""What every benchmark reports beside its timings (the protocol in ``docs/replay.md``)."""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages, printed beside every round."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def median_ratio(times: Sequence[float], base: Sequence[float]) -> float:
    """Median over rounds of each round's ``times / base``: calls made seconds apart share the
    machine's state, so drift between rounds cancels."""
    return statistics.median(x / b for x, b in zip(times, base, strict=True))


def _status_kib(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (None where the file or the field is absent)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_rss_mb() -> float:
    """Peak resident set size of *this* process, MiB: ``VmHWM`` of ``/proc/self/status``.

    Not ``getrusage(RUSAGE_SELF).ru_maxrss``: Linux carries a parent's high-water mark into a
    child across ``fork`` and ``execve`` (the child's memory map starts as a copy of the
    parent's, and exec folds the old map's peak into ``ru_maxrss``), so a benchmark started
    from a large process (pytest with torch loaded) would report the parent's peak. ``VmHWM``
    belongs to the memory map, which exec replaces: it starts afresh in every new program.
    Where ``/proc`` is missing (not Linux) ``ru_maxrss`` is the fallback (KiB on Linux, bytes
    on macOS).
    """
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib / 1024
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def rss_mb() -> float:
    """Current resident set size of this process, MiB (``VmRSS``; NaN where unavailable)."""
    kib = _status_kib("VmRSS")
    return float("nan") if kib is None else kib / 1024
