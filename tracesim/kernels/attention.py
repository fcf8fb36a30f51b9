"""Compiled kernels for the Hájek attention estimator and its linearized variance.

All arithmetic is float64. A query sees the kept keys whose position is <= its own position
(causal), found as a prefix of the position-sorted kept set; a sliding-window rule also drops
the keys at positions ``<= t - window`` (a sliding layer's query at ``t`` attends ``(t - w, t]``).
Each query writes only its own output slots, so results are bit-identical for any number of
numba threads.

The kernels take argument groups (named tuples, compiled by numba as structs, so grouping costs
nothing at run time) instead of twenty positional arrays:

* :class:`LogitRule` -- how a logit is formed: scale, soft-cap, window.
* :class:`KeptTokens` -- the kept tokens of one KV head, sorted by position.
* :class:`EstimateOptions` -- correction on/off, which variance, how much of it.
* :class:`EstimateOutputs` -- the per-query output arrays of :func:`hajek_batch`.

A learned sink (gpt-oss) is a per-query-head logit ``sigma`` that enters the softmax denominator
with value zero: a take-all pseudo-token, so it adds ``exp(sigma)`` to the normaliser and nothing
to the numerator or to the variance (``docs/math.md`` section 4b). ``-inf`` means no sink.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

__all__ = ["EstimateOptions", "EstimateOutputs", "KeptTokens", "LogitRule", "NO_SINK",
           "VARIANCE_FIXED", "VARIANCE_POISSON", "hajek_batch", "hajek_row",
           "output_space_batch"]

VARIANCE_POISSON = 0
VARIANCE_FIXED = 1
#: The sink logit of a head without a learned sink.
NO_SINK = -np.inf


class LogitRule(NamedTuple):
    """How one layer turns ``q . k`` into a logit, and which positions a query attends.

    Attributes
    ----------
    scale : float
        Softmax scale: ``s = scale * q . k``.
    softcap : float
        ``c > 0``: the logit is ``c * tanh(s / c)`` (Gemma 2); ``0.0``: no soft-cap.
    window : int
        ``w > 0``: a query at position ``t`` attends ``(t - w, t]`` (sliding layer); ``0``: every
        position ``<= t`` (full layer).
    """

    scale: float
    softcap: float
    window: int


class KeptTokens(NamedTuple):
    """The kept tokens of one KV head, ``M`` of them, sorted by position.

    Attributes
    ----------
    keys : ndarray of float64, shape (M, d)
    values : ndarray of float64, shape (M, d_v)
    pi : ndarray of float64, shape (M,)
        Inclusion probabilities (1: take-all stratum, contributes no variance).
    offset : ndarray of float64, shape (M,)
        Extra additive logit offset (e.g. log bootstrap weights), zeros for none.
    positions : ndarray of int64, shape (M,)
        Strictly increasing token positions.
    """

    keys: np.ndarray
    values: np.ndarray
    pi: np.ndarray
    offset: np.ndarray
    positions: np.ndarray


class EstimateOptions(NamedTuple):
    """What :func:`hajek_row` computes.

    Attributes
    ----------
    use_offset : bool
        Apply the Hájek ``-log pi`` offset (False: the uncorrected estimate).
    variance_kind : int
        :data:`VARIANCE_POISSON` or :data:`VARIANCE_FIXED` (Rosén's fixed-size approximation).
    want_diag, want_full : bool
        Also write the variance diagonal / the full matrix (and ``tr V^2``).
    """

    use_offset: bool
    variance_kind: int
    want_diag: bool
    want_full: bool


class EstimateOutputs(NamedTuple):
    """Per-query outputs of :func:`hajek_batch` (``n_q`` queries, value dim ``d_v``).

    Attributes
    ----------
    est : ndarray of float64, shape (n_q, d_v)
    diag : ndarray of float64, shape (n_q, d_v), or (n_q, 1) when not wanted
    full : ndarray of float64, shape (n_q, d_v, d_v), or (n_q, 1, 1) when not wanted
    trace, trace_sq, n_eff : ndarray of float64, shape (n_q,)
    tail_size, visible : ndarray of int64, shape (n_q,)
        Kept tail tokens (``pi < 1``) and kept tokens the query sees.
    """

    est: np.ndarray
    diag: np.ndarray
    full: np.ndarray
    trace: np.ndarray
    trace_sq: np.ndarray
    tail_size: np.ndarray
    n_eff: np.ndarray
    visible: np.ndarray


@nb.njit(cache=True)
def visible_range(positions: np.ndarray, query_position: int, window: int) -> tuple[int, int]:
    """``[lo, hi)``: the entries of the sorted ``positions`` a query at ``query_position`` sees.

    A negative query position means "sees everything"; ``window > 0`` keeps positions
    ``> query_position - window`` only.
    """
    if query_position < 0:
        return 0, positions.size
    hi = np.searchsorted(positions, query_position, side="right")
    lo = 0
    if window > 0:
        lo = np.searchsorted(positions, query_position - window, side="right")
    return lo, hi


@nb.njit(cache=True)
def logit(q: np.ndarray, k: np.ndarray, rule: LogitRule) -> float:
    """``scale * q . k``, soft-capped by ``rule.softcap`` when it is positive."""
    z = 0.0
    for j in range(q.size):
        z += q[j] * k[j]
    z = z * rule.scale
    if rule.softcap > 0.0:
        z = rule.softcap * np.tanh(z / rule.softcap)
    return z


@nb.njit(cache=True)
def hajek_row(
    q: np.ndarray, kept: KeptTokens, lo: int, hi: int, rule: LogitRule, sink: float,
    opts: EstimateOptions, est: np.ndarray, diag: np.ndarray, full: np.ndarray,
    weights: np.ndarray,
) -> tuple[float, float, int, float]:
    """Hájek estimate and linearized variance for one query over kept tokens ``lo:hi``.

    ``sink`` is the head's sink logit (:data:`NO_SINK` for none): a take-all term of value 0
    in the denominator. Writes the estimate into ``est`` (d_v,), the variance diagonal into
    ``diag`` and the full matrix into ``full`` (d_v, d_v) when ``opts`` asks; ``weights``
    (>= hi - lo,) is scratch and ends holding the normalised weights ``a_i``.
    Returns ``(trace, trace_of_square, tail_size, tail_kish_n_eff)``; ``trace_of_square`` is
    computed only with ``opts.want_full`` (else NaN).
    """
    keys, values, pi, offset = kept.keys, kept.values, kept.pi, kept.offset
    dv = values.shape[1]
    count = hi - lo
    has_sink = sink > -np.inf
    # Pass 1: logits with the -log(pi) offset (Hájek) plus any extra offset (bootstrap).
    top = -np.inf
    for r in range(count):
        i = lo + r
        z = logit(q, keys[i], rule) + offset[i]
        if opts.use_offset:
            z -= np.log(pi[i])
        weights[r] = z
        if z > top:
            top = z
    if has_sink and sink > top:
        top = sink
    total = 0.0
    for r in range(count):
        w = np.exp(weights[r] - top)
        weights[r] = w
        total += w
    if has_sink:
        total += np.exp(sink - top)
    for j in range(dv):
        est[j] = 0.0
    for r in range(count):
        a = weights[r] / total
        weights[r] = a
        for j in range(dv):
            est[j] += a * values[lo + r, j]
    # Pass 2: variance over the sampled tail (pi < 1); take-all tokens (and the sink)
    # contribute nothing.
    m = 0
    sum_a = 0.0
    sum_a2 = 0.0
    sum_c = 0.0
    centre = np.zeros(dv)
    for r in range(count):
        i = lo + r
        if pi[i] < 1.0:
            a = weights[r]
            m += 1
            sum_a += a
            sum_a2 += a * a
            if opts.variance_kind == VARIANCE_FIXED:
                c = 1.0 - pi[i]
                sum_c += c
                for j in range(dv):
                    centre[j] += c * a * (values[i, j] - est[j])
    inflate = 1.0
    if opts.variance_kind == VARIANCE_FIXED:
        # Rosén's fixed-size approximation: centre z_i = a_i r_i and inflate by m/(m-1).
        if m <= 1:
            inflate = 0.0
        else:
            inflate = m / (m - 1.0)
            for j in range(dv):
                centre[j] /= sum_c
    if opts.want_diag:
        for j in range(dv):
            diag[j] = 0.0
    if opts.want_full:
        for j in range(dv):
            for k in range(dv):
                full[j, k] = 0.0
    trace = 0.0
    z = np.empty(dv)
    for r in range(count):
        i = lo + r
        if pi[i] < 1.0:
            a = weights[r]
            c = 1.0 - pi[i]
            for j in range(dv):
                z[j] = a * (values[i, j] - est[j]) - centre[j]
            acc = 0.0
            for j in range(dv):
                acc += z[j] * z[j]
            trace += c * acc
            if opts.want_diag:
                for j in range(dv):
                    diag[j] += c * z[j] * z[j]
            if opts.want_full:
                for j in range(dv):
                    cz = c * z[j]
                    for k in range(dv):
                        full[j, k] += cz * z[k]
    trace *= inflate
    trace_sq = np.nan
    if opts.want_diag:
        for j in range(dv):
            diag[j] *= inflate
    if opts.want_full:
        trace_sq = 0.0
        for j in range(dv):
            for k in range(dv):
                full[j, k] *= inflate
                trace_sq += full[j, k] * full[j, k]
    n_eff = (sum_a * sum_a / sum_a2) if sum_a2 > 0.0 else 0.0
    return trace, trace_sq, m, n_eff


@nb.njit(cache=True, parallel=True)
def hajek_batch(
    queries: np.ndarray, query_positions: np.ndarray, kept: KeptTokens, rule: LogitRule,
    sink: float, opts: EstimateOptions, out: EstimateOutputs,
) -> None:
    """Run :func:`hajek_row` for every query of one head (``queries`` (n_q, d) at
    ``query_positions`` (n_q,), negative: sees every kept token) over ``kept``."""
    n_q = queries.shape[0]
    dv = kept.values.shape[1]
    positions, window = kept.positions, rule.window
    # One field per statement, before the parallel loop: with the fields read inside prange,
    # or unpacked as one tuple, numba's parfor pass silently lost some of the stores.
    est = out.est
    diag = out.diag
    full = out.full
    trace = out.trace
    trace_sq = out.trace_sq
    tail_size = out.tail_size
    n_eff = out.n_eff
    visible = out.visible
    for r in nb.prange(n_q):
        lo, hi = visible_range(positions, query_positions[r], window)
        visible[r] = hi - lo
        if hi == lo:
            for j in range(dv):
                est[r, j] = np.nan
            trace[r] = np.nan
            continue
        weights = np.empty(hi - lo)
        # diag/full are (n_q, 1) and (n_q, 1, 1) placeholders when not wanted.
        t, t2, m, ne = hajek_row(queries[r], kept, lo, hi, rule, sink, opts, est[r], diag[r],
                                 full[r], weights)
        trace[r] = t
        trace_sq[r] = t2
        tail_size[r] = m
        n_eff[r] = ne


@nb.njit(cache=True, parallel=True)
def output_space_batch(
    queries: np.ndarray, query_positions: np.ndarray, kept: KeptTokens, rule: LogitRule,
    sinks: np.ndarray, gram: np.ndarray, est: np.ndarray, variance: np.ndarray,
) -> None:
    """Linearized output-space variance of one GQA group (query heads sharing one sample).

    ``queries`` (G, n_q, d) are the group's heads, ``sinks`` (G,) their sink logits
    (:data:`NO_SINK` for none); ``gram`` (G*d, G*d) is ``W_g^T W_g`` for the group's block
    ``W_g`` of ``o_proj``, so ``||W_g U||^2 = U^T gram U``. Writes the per-head estimates
    ``est`` (G, n_q, d_v) and ``variance`` (n_q,):
    ``sum_{i in S} (1 - pi_i) || sum_h a_{h,i} W_h (v_i - o_h) ||^2``.
    """
    G = queries.shape[0]
    n_q = queries.shape[1]
    pi, values, positions, window = kept.pi, kept.values, kept.positions, rule.window
    dv = values.shape[1]
    opts = EstimateOptions(True, VARIANCE_POISSON, False, False)
    for r in nb.prange(n_q):
        lo, hi = visible_range(positions, query_positions[r], window)
        count = hi - lo
        if count == 0:
            variance[r] = np.nan
            continue
        weights = np.empty((G, count))
        scratch = np.empty(1)
        full = np.empty((1, 1))
        for h in range(G):
            hajek_row(queries[h, r], kept, lo, hi, rule, sinks[h], opts, est[h, r], scratch,
                      full, weights[h])
        u = np.empty(G * dv)
        total = 0.0
        for c in range(count):
            i = lo + c
            if pi[i] < 1.0:
                for h in range(G):
                    a = weights[h, c]
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
