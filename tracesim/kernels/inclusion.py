"""Compiled kernels for inclusion probabilities and fixed-size order sampling."""

from __future__ import annotations

import numba as nb
import numpy as np


@nb.njit(cache=True)
def capped_pps_scale(x: np.ndarray, n: float, floor: float) -> float:
    """Solve ``sum_i clip(c * x_i, floor, 1) = n`` for c exactly.

    ``f(c) = sum_i clip(c x_i, floor, 1)`` is piecewise linear and non-decreasing in c. Token i
    (with ``x_i > 0``) leaves the floor at ``c = floor / x_i`` and reaches the cap at
    ``c = 1 / x_i``. In ascending score order the tokens at the floor, in between and at the cap
    are three contiguous runs ``[0, lo)``, ``[lo, hi)``, ``[hi, N)``; a sweep over the sorted
    breakpoints moves ``lo`` and ``hi`` down, so ``f(c) = lo*floor + c*sum(x[lo:hi]) + (N-hi)``
    with the sum taken from ascending prefix sums (no running subtraction that could cancel when
    scores span many orders of magnitude). One division then gives c. Cost O(N log N).
    Returns -1.0 if n cannot be reached.
    """
    if floor == 0.0:
        c = _scale_by_capping(x, n)
        if c == c:  # not NaN: the fixed point was reached without sorting
            return c
    N = x.size
    xs = np.sort(x)
    prefix = np.zeros(N + 1)
    for i in range(N):
        prefix[i + 1] = prefix[i] + xs[i]
    first_positive = np.searchsorted(xs, 0.0, side="right")
    if floor == 0.0:
        return _scale_without_floor(xs, prefix, first_positive, n, floor)
    return _scale_by_sweep(xs, prefix, first_positive, n, floor)


#: Rounds of :func:`_scale_by_capping` before it gives up (then the sort sweep runs). Each
#: round caps every token the previous scale pushes to 1; attention scores settle in a few.
CAPPING_ROUNDS = 12


@nb.njit(cache=True)
def _scale_by_capping(x, n):
    """:func:`capped_pps_scale` without a floor, by capping rounds instead of a sort: O(N) per
    round, NaN when it does not settle in :data:`CAPPING_ROUNDS` rounds or ``n`` is not below
    the number of positive scores (the sweep then decides).

    ``c = n / sum x``; every token with ``c x_i >= 1`` is capped and ``c`` recomputed from the
    rest, ``c = (n - capped) / sum_uncapped x``. ``c`` only grows, so the capped set only
    grows; when a round caps no new token, ``sum_i min(c x_i, 1) = n`` holds and ``c`` is the
    unique solution the sweep finds (``f`` is strictly increasing while a positive score is
    uncapped). The sums run in position order, the sweep's over sorted prefix sums: the two
    agree to rounding, not bit for bit.
    """
    total = 0.0
    n_pos = 0
    for i in range(x.size):
        if x[i] > 0.0:
            total += x[i]
            n_pos += 1
    if not (n < n_pos and total < np.inf):
        return np.nan
    capped = 0
    c = n / total
    for _ in range(CAPPING_ROUNDS):
        count = 0
        rest = 0.0
        for i in range(x.size):
            if c * x[i] >= 1.0:
                count += 1
            else:
                rest += x[i]
        if count == capped:
            return c
        if not rest > 0.0:
            return np.nan
        capped = count
        c = (n - count) / rest
    return np.nan


@nb.njit(cache=True)
def _scale_by_sweep(xs, prefix, first_positive, n, floor):
    """:func:`capped_pps_scale`'s sweep over the stably sorted breakpoints (any ``floor``);
    ``xs`` sorted ascending, ``prefix`` its prefix sums, ``xs[first_positive:] > 0``."""
    N = xs.size
    n_pos = N - first_positive
    at = np.empty(2 * n_pos)
    kind = np.empty(2 * n_pos, dtype=np.int8)  # 0: leaves the floor, 1: reaches the cap
    for j in range(n_pos):
        at[2 * j] = floor / xs[first_positive + j]
        kind[2 * j] = 0
        at[2 * j + 1] = 1.0 / xs[first_positive + j]
        kind[2 * j + 1] = 1
    order = np.argsort(at, kind="mergesort")
    lo = N
    hi = N
    for e in range(2 * n_pos):
        k = order[e]
        c = _crossing(at[k], prefix, lo, hi, N, n, floor)
        if c == c:  # not NaN: the budget is reached at this breakpoint
            return c
        if kind[k] == 0:
            lo -= 1
        else:
            hi -= 1
    # Every positive-score token is capped; the rest sit at the floor.
    if lo * floor + (N - hi) >= n * (1 - 1e-12):
        return at[order[2 * n_pos - 1]] if n_pos > 0 else 0.0
    return -1.0


@nb.njit(cache=True, inline="always")
def _crossing(c, prefix, lo, hi, N, n, floor):
    """The scale if the expected size at breakpoint ``c`` reaches ``n`` (the general sweep's
    expressions, in its order), else NaN."""
    slope = prefix[hi] - prefix[lo]
    value = lo * floor + slope * c + (N - hi)
    if value >= n:
        if slope > 0.0:
            return (n - lo * floor - (N - hi)) / slope
        return c
    return np.nan


@nb.njit(cache=True)
def _scale_without_floor(xs, prefix, first_positive, n, floor):
    """:func:`capped_pps_scale`'s sweep when ``floor`` is 0, without sorting the breakpoints.

    Every "leaves the floor" breakpoint is then ``floor / x = 0`` and every "reaches the cap"
    one ``1 / x > 0``, so the stable sort of the general sweep puts the former first (in
    ascending score order) and the latter in ascending ``1 / x``, i.e. descending score
    (``1 / x`` is monotone; among equal breakpoints the order is immaterial: each event only
    moves ``lo`` or ``hi`` by one and they share ``c``). The same expressions are evaluated
    at the same breakpoints in the same order, so the result is the general sweep's, bit for
    bit, at O(N) after the sort of the scores.
    """
    N = xs.size
    n_pos = N - first_positive
    lo = N
    hi = N
    for j in range(n_pos):
        c = _crossing(floor / xs[first_positive + j], prefix, lo, hi, N, n, floor)
        if c == c:  # not NaN: the budget is reached at this breakpoint
            return c
        lo -= 1
    for j in range(n_pos - 1, -1, -1):
        c = _crossing(1.0 / xs[first_positive + j], prefix, lo, hi, N, n, floor)
        if c == c:
            return c
        hi -= 1
    if lo * floor + (N - hi) >= n * (1 - 1e-12):
        return 1.0 / xs[first_positive] if n_pos > 0 else 0.0
    return -1.0


@nb.njit(cache=True)
def apply_capped_pps(x: np.ndarray, c: float, floor: float, out: np.ndarray) -> None:
    for i in range(x.size):
        p = c * x[i]
        if p >= 1.0:
            p = 1.0
        elif p < floor:
            p = floor
        out[i] = p


@nb.njit(cache=True)
def order_sample(target: np.ndarray, u: np.ndarray, n: int, pareto: bool,
                 kept: np.ndarray) -> None:
    """Keep the n tokens with the smallest ranking variable (Rosén's order sampling).

    Sequential Poisson ranks by ``u / lambda``; Pareto by ``[u/(1-u)] / [lambda/(1-lambda)]``.
    ``lambda = 1`` ranks first (always kept), ``lambda = 0`` never ranks. Ties are broken by the
    lower index so the result is a deterministic function of (target, u).
    """
    N = target.size
    q = np.empty(N)
    for i in range(N):
        lam = target[i]
        if lam >= 1.0:
            q[i] = -1.0
        elif lam <= 0.0:
            q[i] = np.inf
        elif pareto:
            q[i] = (u[i] / (1.0 - u[i])) / (lam / (1.0 - lam))
        else:
            q[i] = u[i] / lam
    order = np.argsort(q, kind="mergesort")
    for i in range(N):
        kept[i] = False
    for r in range(min(n, N)):
        i = order[r]
        if q[i] == np.inf:
            break
        kept[i] = True
