"""The start-up floor of any numba command line: import numba and call one tiny function from
numba's on-disk cache (``cache=True``), nothing else. ``bench_cli.py`` times it next to
``tracesim replay`` so the replay's own start-up cost reads against what numba alone needs.

Usage: ``python benchmarks/numba_floor.py``
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True)
def _total(a: np.ndarray) -> float:
    return a.sum()


if __name__ == "__main__":
    _total(np.ones(8))
