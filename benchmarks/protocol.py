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
