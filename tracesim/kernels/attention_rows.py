"""Compiled full-cache attention rows of one query head: the observation window of a score.

Scores such as SnapKV, TOVA and the kvpress presses read the softmax attention of a few stored
queries over the whole cache (:meth:`tracesim.layer_trace.LayerTrace.attention`). Done in numpy
this was one GEMM plus a dozen full-size temporaries (two masks, the exponentials, the
normalised copy and one row per query); this kernel writes each row once, in place.

All arithmetic is float64. Each row is computed by one loop in a fixed order (the dot products
may be reassociated by the compiler, which is fixed at compile time), so the rows do not depend
on the number of threads; they agree with the numpy formula to rounding (1e-12 relative in the
tests, ``tests/test_attention_rows.py``).
"""

from __future__ import annotations

import numba as nb
import numpy as np

__all__ = ["softmax_rows"]


@nb.njit(cache=True, fastmath={"reassoc", "contract"})
def _logit_row(keys, q, t, lo, rule, row):
    """Logits of positions ``[lo, t]`` into ``row``; returns their maximum."""
    d = q.size
    top = -np.inf
    for i in range(lo, t + 1):
        z = 0.0
        for k in range(d):
            z += keys[i, k] * q[k]
        z *= rule.scale
        if rule.softcap > 0.0:
            z = rule.softcap * np.tanh(z / rule.softcap)
        row[i] = z
        if z > top:
            top = z
    return top


@nb.njit(cache=True)
def softmax_rows(keys, queries, positions, rule, sink, out):
    """Write the softmax attention of each query over the cache into ``out``.

    keys : float64 (P, d), the KV head's keys (C-contiguous)
    queries : float64 (n, d), the query head's queries, one per row of ``out``
    positions : int64 (n,), each query's position ``t`` (it attends ``[lo, t]``)
    rule : LogitRule (:mod:`tracesim.kernels.attention`), scale, soft-cap (0: none), window
    sink : float, the head's learned sink logit, ``-inf`` for none (adds ``exp(sink)`` to the
        normaliser only)
    out : float64 (n, P), zero-filled; row ``j`` receives query ``j``'s attention, zero
        outside ``[lo, t]``
    """
    for j in range(queries.shape[0]):
        t = positions[j]
        lo = max(0, t - rule.window + 1) if rule.window > 0 else 0
        row = out[j]
        top = _logit_row(keys, queries[j], t, lo, rule, row)
        if sink > top:
            top = sink
        total = 0.0
        for i in range(lo, t + 1):
            w = np.exp(row[i] - top)
            row[i] = w
            total += w
        if sink > -np.inf:
            total += np.exp(sink - top)
        for i in range(lo, t + 1):
            row[i] /= total
