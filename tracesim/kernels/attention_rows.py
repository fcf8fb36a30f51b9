"""Compiled full-cache attention rows of query heads: the observation window of a score.

Scores such as SnapKV, TOVA and the kvpress presses read the softmax attention of a few stored
queries over the whole cache (:meth:`tracesim.layer_trace.LayerTrace.attention`). Done in numpy
this was one GEMM plus a dozen full-size temporaries (two masks, the exponentials, the
normalised copy and one row per query); these kernels write each row once, in place.

:func:`head_rows` computes the rows of several query heads of a layer in one call, in
parallel over the rows when the work is large enough (a score asks for a whole GQA group's
rows at once).

All arithmetic is float64. Each row is computed by one loop in a fixed order (the dot products
may be reassociated by the compiler, which is fixed at compile time), and every row is written
by one job, so the rows do not depend on the number of threads; they agree with the numpy
formula to rounding (1e-12 relative in the tests, ``tests/test_attention_rows.py``).
"""

from __future__ import annotations

import numba as nb
import numpy as np

__all__ = ["SERIAL_BELOW", "head_rows", "softmax_rows"]

#: :func:`head_rows` of less work (rows x positions x head dim) runs serially. On a quiet
#: 2-core machine the parallel path paid at a GQA group's 96 rows of 1,024 positions (6.3 M
#: multiply-adds, about 2 ms a call): the one configuration of ``docs/replay.md`` took 12 %
#: less wall time (medians of 9 alternated rounds). Under load it cost more than it saved
#: (every region waits for a descheduled worker); figures are quoted from a quiet machine.
SERIAL_BELOW = 1 << 22


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
def _softmax_row(keys, q, t, rule, sink, row):
    """Softmax attention of query ``q`` at position ``t`` into the zero-filled ``row``."""
    lo = max(0, t - rule.window + 1) if rule.window > 0 else 0
    top = _logit_row(keys, q, t, lo, rule, row)
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
        _softmax_row(keys, queries[j], positions[j], rule, sink, out[j])


@nb.njit(cache=True, parallel=True)
def _head_rows_par(keys, queries, heads, qidx, positions, rule, sinks, out):
    G = queries.shape[0] // keys.shape[0]
    for j in nb.prange(heads.size):
        h = heads[j]
        _softmax_row(keys[h // G], queries[h, qidx[j]], positions[qidx[j]], rule, sinks[h],
                     out[j])


@nb.njit(cache=True)
def _head_rows_ser(keys, queries, heads, qidx, positions, rule, sinks, out):
    G = queries.shape[0] // keys.shape[0]
    for j in range(heads.size):
        h = heads[j]
        _softmax_row(keys[h // G], queries[h, qidx[j]], positions[qidx[j]], rule, sinks[h],
                     out[j])


def head_rows(keys: np.ndarray, queries: np.ndarray, heads: np.ndarray, qidx: np.ndarray,
              positions: np.ndarray, rule, sinks: np.ndarray, out: np.ndarray) -> None:
    """Softmax attention rows of (query head, stored query) pairs of one layer into ``out``.

    keys : float64 (n_kv, P, d), the layer's keys (C-contiguous); query head ``h`` reads
        KV head ``h // G`` with ``G = H / n_kv``
    queries : float64 (H, n_query, d), every stored query of every query head (C-contiguous)
    heads, qidx : int64 (n,), row ``j`` is query ``qidx[j]`` of head ``heads[j]``
    positions : int64 (n_query,), the stored queries' positions
    rule : LogitRule (:mod:`tracesim.kernels.attention`), scale, soft-cap (0: none), window
    sinks : float64 (H,), each head's learned sink logit, ``-inf`` for none
    out : float64 (n, P), zero-filled; row ``j`` as :func:`softmax_rows` writes it

    Each row is one job computed by the same compiled loop as :func:`softmax_rows`; rows run in
    parallel when the work is at least :data:`SERIAL_BELOW`, and the result does not depend on
    the number of threads.
    """
    work = heads.size * keys.shape[1] * keys.shape[2]
    (_head_rows_ser if work < SERIAL_BELOW else _head_rows_par)(
        keys, queries, heads, qidx, positions, rule, sinks, out)
