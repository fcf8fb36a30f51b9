"""Compiled kernels for the Hájek attention estimator and its linearized variance.

All arithmetic is float64. A query sees the kept keys whose position is <= its own position
(causal), found as a prefix of the position-sorted kept set. Each query writes only its own
output slots, so results are bit-identical for any number of numba threads.
"""

from __future__ import annotations

import numba as nb
import numpy as np

VARIANCE_POISSON = 0
VARIANCE_FIXED = 1


@nb.njit(cache=True)
def _visible_count(positions: np.ndarray, query_position: int) -> int:
    # positions are sorted; a negative query position means "sees everything".
    if query_position < 0:
        return positions.size
    return np.searchsorted(positions, query_position, side="right")


@nb.njit(cache=True)
def hajek_row(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, pi: np.ndarray, offset: np.ndarray,
    count: int, scale: float, use_offset: bool, variance_kind: int, want_diag: bool,
    want_full: bool, est: np.ndarray, diag: np.ndarray, full: np.ndarray, weights: np.ndarray,
) -> tuple[float, float, int, float]:
    """Hájek estimate and linearized variance for one query over the first ``count`` kept keys.

    Writes the estimate into ``est`` (d_v,), the variance diagonal into ``diag`` and the full
    matrix into ``full`` (d_v, d_v) when asked; ``weights`` (>= count,) is scratch.
    Returns ``(trace, trace_of_square, tail_size, tail_kish_n_eff)``; ``trace_of_square`` is
    computed only with ``want_full`` (else NaN).
    """
    d = keys.shape[1]
    dv = values.shape[1]
    # Pass 1: logits with the -log(pi) offset (Hájek) plus any extra offset (bootstrap).
    top = -np.inf
    for i in range(count):
        z = 0.0
        for j in range(d):
            z += q[j] * keys[i, j]
        z = z * scale + offset[i]
        if use_offset:
            z -= np.log(pi[i])
        weights[i] = z
        if z > top:
            top = z
    total = 0.0
    for i in range(count):
        w = np.exp(weights[i] - top)
        weights[i] = w
        total += w
    for j in range(dv):
        est[j] = 0.0
    for i in range(count):
        a = weights[i] / total
        weights[i] = a
        for j in range(dv):
            est[j] += a * values[i, j]
    # Pass 2: variance over the sampled tail (pi < 1); take-all tokens contribute nothing.
    m = 0
    sum_a = 0.0
    sum_a2 = 0.0
    sum_c = 0.0
    centre = np.zeros(dv)
    for i in range(count):
        if pi[i] < 1.0:
            a = weights[i]
            m += 1
            sum_a += a
            sum_a2 += a * a
            if variance_kind == VARIANCE_FIXED:
                c = 1.0 - pi[i]
                sum_c += c
                for j in range(dv):
                    centre[j] += c * a * (values[i, j] - est[j])
    inflate = 1.0
    if variance_kind == VARIANCE_FIXED:
        # Rosén's fixed-size approximation: centre z_i = a_i r_i and inflate by m/(m-1).
        if m <= 1:
            inflate = 0.0
        else:
            inflate = m / (m - 1.0)
            for j in range(dv):
                centre[j] /= sum_c
    if want_diag:
        for j in range(dv):
            diag[j] = 0.0
    if want_full:
        for j in range(dv):
            for k in range(dv):
                full[j, k] = 0.0
    trace = 0.0
    z = np.empty(dv)
    for i in range(count):
        if pi[i] < 1.0:
            a = weights[i]
            c = 1.0 - pi[i]
            for j in range(dv):
                z[j] = a * (values[i, j] - est[j]) - centre[j]
            acc = 0.0
            for j in range(dv):
                acc += z[j] * z[j]
            trace += c * acc
            if want_diag:
                for j in range(dv):
                    diag[j] += c * z[j] * z[j]
            if want_full:
                for j in range(dv):
                    cz = c * z[j]
                    for k in range(dv):
                        full[j, k] += cz * z[k]
    trace *= inflate
    trace_sq = np.nan
    if want_diag:
        for j in range(dv):
            diag[j] *= inflate
    if want_full:
        trace_sq = 0.0
        for j in range(dv):
            for k in range(dv):
                full[j, k] *= inflate
                trace_sq += full[j, k] * full[j, k]
    n_eff = (sum_a * sum_a / sum_a2) if sum_a2 > 0.0 else 0.0
    return trace, trace_sq, m, n_eff


@nb.njit(cache=True, parallel=True)
def hajek_batch(
    queries: np.ndarray, query_positions: np.ndarray, keys: np.ndarray, values: np.ndarray,
    pi: np.ndarray, offset: np.ndarray, key_positions: np.ndarray, scale: float,
    use_offset: bool, variance_kind: int, want_diag: bool, want_full: bool,
    est: np.ndarray, diag: np.ndarray, full: np.ndarray, trace: np.ndarray,
    trace_sq: np.ndarray, tail_size: np.ndarray, n_eff: np.ndarray, visible: np.ndarray,
) -> None:
    """Run :func:`hajek_row` for every query; ``keys``/``values``/``pi``/``offset`` are the
    kept tokens only, sorted by ``key_positions``."""
    n_q = queries.shape[0]
    dv = values.shape[1]
    for r in nb.prange(n_q):
        count = _visible_count(key_positions, query_positions[r])
        visible[r] = count
        if count == 0:
            for j in range(dv):
                est[r, j] = np.nan
            trace[r] = np.nan
            continue
        weights = np.empty(count)
        # diag/full are (n_q, 1) and (n_q, 1, 1) placeholders when not wanted.
        t, t2, m, ne = hajek_row(
            queries[r], keys, values, pi, offset, count, scale, use_offset, variance_kind,
            want_diag, want_full, est[r], diag[r], full[r], weights,
        )
        trace[r] = t
        trace_sq[r] = t2
        tail_size[r] = m
        n_eff[r] = ne


@nb.njit(cache=True, parallel=True)
def output_space_batch(
    queries: np.ndarray, query_positions: np.ndarray, keys: np.ndarray, values: np.ndarray,
    pi: np.ndarray, key_positions: np.ndarray, gram: np.ndarray, scale: float,
    est: np.ndarray, variance: np.ndarray,
) -> None:
    """Linearized output-space variance of one GQA group (query heads sharing one sample).

    ``queries`` (G, n_q, d) are the group's heads; ``gram`` (G*d, G*d) is ``W_g^T W_g`` for the
    group's block ``W_g`` of ``o_proj``, so ``||W_g U||^2 = U^T gram U``. Writes the per-head
    estimates ``est`` (G, n_q, d_v) and ``variance`` (n_q,):
    ``sum_{i in S} (1 - pi_i) || sum_h a_{h,i} W_h (v_i - o_h) ||^2``.
    """
    G = queries.shape[0]
    n_q = queries.shape[1]
    dv = values.shape[1]
    zero_offset = np.zeros(keys.shape[0])
    for r in nb.prange(n_q):
        count = _visible_count(key_positions, query_positions[r])
        if count == 0:
            variance[r] = np.nan
            continue
        weights = np.empty((G, count))
        scratch = np.empty(1)
        full = np.empty((1, 1))
        for h in range(G):
            hajek_row(queries[h, r], keys, values, pi, zero_offset, count, scale, True,
                      VARIANCE_POISSON, False, False, est[h, r], scratch, full, weights[h])
        u = np.empty(G * dv)
        total = 0.0
        for i in range(count):
            if pi[i] < 1.0:
                for h in range(G):
                    a = weights[h, i]
                    for j in range(dv):
                        u[h * dv + j] = a * (values[i, j] - est[h, r, j])
                quad = 0.0
                for j in range(G * dv):
                    row = 0.0
                    for k in range(G * dv):
                        row += gram[j, k] * u[k]
                    quad += u[j] * row
                total += (1.0 - pi[i]) * quad
        variance[r] = total
