"""Compiled KIVI-style key quantisation (:func:`tracesim.proxies.quant.quantise_keys`).

The numpy formula runs a dozen passes and temporaries over the keys; here every group of
tokens is read once per channel while it is in cache. The arithmetic is the formula's, entry by
entry, in the same order (minimum, maximum, step, rounding to the nearest level with ties to
even), so the result is the same float64 values.
"""

from __future__ import annotations

import numba as nb
import numpy as np

__all__ = ["quantise_groups"]


@nb.njit(cache=True)
def quantise_groups(K, levels, group, out):
    """Round-trip the keys through ``levels + 1`` levels per channel and group of tokens.

    K : float64 (P, d), the keys
    levels : int, ``2**bits - 1``
    group : int, tokens per group, from position 0 (the last group may be shorter)
    out : float64 (P, d), receives the dequantised keys
    """
    P, d = K.shape
    for a in range(0, P, group):
        b = min(P, a + group)
        for k in range(d):
            lo = K[a, k]
            hi = K[a, k]
            nan = lo != lo
            for p in range(a + 1, b):
                v = K[p, k]
                nan |= v != v
                if v < lo:
                    lo = v
                if v > hi:
                    hi = v
            if nan:  # numpy's minimum and maximum propagate a NaN
                lo = np.nan
                hi = np.nan
            step = (hi - lo) / levels
            safe = step if step > 0 else 1.0
            for p in range(a, b):
                out[p, k] = lo + np.rint((K[p, k] - lo) / safe) * step
