"""Compiled inclusion probabilities of many (event, KV head) rows under Poisson capped PPS.

A per-step design draws a fresh sample at every decode step of every KV head, so one layer has
``steps x KV heads`` rows of :func:`tracesim.replay.head_rows.head_inclusion` (192 on the
benchmark layer of ``bench_perstep.py``). In Python each row cost a dozen numpy passes and as
many temporaries (tail selection, top-h, the mixture, the capped scale); here each row is one
compiled call, and the rows run in parallel.

Each row repeats :func:`~tracesim.replay.head_rows.head_inclusion` with
:class:`~tracesim.designs.poisson.PoissonPPS` operation for operation, so its ``pi`` are the
same float64 values: the tail in position order, the top-h by one partition (ties to the later
position), zero scores lifted as ``_usable_scores`` does, the scores divided by their maximum,
the mixture's sum added pairwise as numpy adds a contiguous array (:func:`_numpy_sum`), and the
capped scale from :func:`tracesim.kernels.inclusion.capped_pps_scale`. A row whose scores the
Python path would refuse (not finite, negative, a budget the scores cannot reach) is not
computed here: its status says so and the caller runs the Python path, which raises the error
that names the problem.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from tracesim.kernels.inclusion import apply_capped_pps, capped_pps_scale

__all__ = ["ROW_OK", "ROW_REFUSED", "poisson_rows"]

#: Status of a row: computed, or left to the Python path (which raises the error).
ROW_OK, ROW_REFUSED = 0, 1
#: Rows times positions below which the rows run serially (a parallel region costs more than
#: it saves on a few short rows).
SERIAL_BELOW = 1 << 16
#: numpy's pairwise summation: blocks of at most this many entries are added by eight
#: interleaved accumulators (``PW_BLOCKSIZE`` of numpy's ``loops_utils.h``).
_PAIRWISE_BLOCK = 128


@nb.njit(cache=True)
def _block_sum(a, lo, n):
    """numpy's sum of a block of at most :data:`_PAIRWISE_BLOCK` entries ``a[lo:lo + n]``:
    fewer than 8 one by one from 0, else eight interleaved accumulators, combined pairwise,
    then the entries past the last multiple of 8 one by one."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r = np.empty(8)
    for k in range(8):
        r[k] = a[lo + k]
    i = 8
    stop = n - n % 8
    while i < stop:
        for k in range(8):
            r[k] += a[lo + i + k]
        i += 8
    res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@nb.njit(cache=True)
def _numpy_sum(a, lo, n):
    """``a[lo:lo + n].sum()`` as numpy adds a contiguous float64 array, bit for bit: pairwise,
    a range of more than :data:`_PAIRWISE_BLOCK` entries cut at half its length rounded down to
    a multiple of 8, the two halves' sums added; blocks by :func:`_block_sum`.

    The recursion runs on an explicit stack (numba's on-disk cache does not load a recursive
    function back safely: the second process crashed).
    """
    if n <= _PAIRWISE_BLOCK:
        return _block_sum(a, lo, n)
    depth = 64  # halves shrink n by 2 at least: more than enough for any array
    f_lo = np.empty(depth, np.int64)
    f_n = np.empty(depth, np.int64)
    f_stage = np.empty(depth, np.int64)  # 0: start, 1: left half summed, 2: both summed
    f_left = np.empty(depth)
    f_lo[0], f_n[0], f_stage[0] = lo, n, 0
    sp = 1
    result = 0.0
    while sp > 0:
        top = sp - 1
        nn = f_n[top]
        half = nn // 2
        half -= half % 8
        if nn <= _PAIRWISE_BLOCK or f_stage[top] == 2:
            # A finished frame: a block, or a range whose halves are summed (f_left holds the
            # left half's sum and the right one arrives as ``value`` below).
            value = _block_sum(a, f_lo[top], nn) if nn <= _PAIRWISE_BLOCK else f_left[top]
            sp -= 1
            if sp == 0:
                result = value
            elif f_stage[sp - 1] == 1:
                f_left[sp - 1] = value
            else:
                f_left[sp - 1] = f_left[sp - 1] + value
        elif f_stage[top] == 0:
            f_stage[top] = 1
            f_lo[sp], f_n[sp], f_stage[sp] = f_lo[top], half, 0
            sp += 1
        else:
            f_stage[top] = 2
            f_lo[sp], f_n[sp], f_stage[sp] = f_lo[top] + half, nn - half, 0
            sp += 1
    return result


@nb.njit(cache=True)
def _drop_top_later(x, tail, h):
    """Remove from ``x`` and ``tail`` (in place, order kept) the ``h`` largest scores, the later
    position first among equal ones (``_top_later``'s set); returns how many are left."""
    size = x.size
    v = np.partition(x, size - h)[size - h]
    above = 0
    n_ties = 0
    for i in range(size):
        if x[i] > v:
            above += 1
        elif x[i] == v:
            n_ties += 1
    ties_out = h - above  # the last ties_out entries equal to v are in the top-h
    ties_seen = 0
    k = 0
    for i in range(size):
        xi = x[i]
        if xi > v:
            continue
        if xi == v:
            ties_seen += 1
            if ties_seen > n_ties - ties_out:
                continue
        x[k] = xi
        tail[k] = tail[i]
        k += 1
    return k


@nb.njit(cache=True)
def _poisson_pi(x, n, mixture, floor, out):
    """:func:`tracesim.designs.poisson.inclusion_probabilities` of tail scores ``x`` (already
    lifted by ``_usable_scores``) into ``out``; False where the Python function raises."""
    N = x.size
    for i in range(N):
        if not (np.isfinite(x[i]) and x[i] >= 0.0):
            return False
    if floor * N > n * (1 + 1e-12):
        return False
    top = 0.0
    if N:
        top = x[0]
        for i in range(1, N):
            if x[i] > top:
                top = x[i]
    if top > 0.0:
        for i in range(N):
            x[i] = x[i] / top
    total = _numpy_sum(x, 0, N)
    if total <= 0.0 and mixture < 1.0:
        return False
    if mixture > 0.0:
        share = mixture / N
        for i in range(N):
            x[i] = (1.0 - mixture) * (x[i] / total if total > 0 else 0.0 * x[i]) + share
    positive = 0
    for i in range(N):
        if x[i] > 0:
            positive += 1
    if positive + (N - positive) * floor < n * (1 - 1e-12):
        return False
    if n >= N:
        for i in range(N):
            out[i] = 1.0
        return True
    c = capped_pps_scale(x, n, floor)
    if c < 0:
        return False
    apply_capped_pps(x, c, floor, out)
    return True


@nb.njit(cache=True)
def poisson_row(scores, take_all, first_alive, tail_budget, top_fraction, mixture, floor, pi):
    """``head_inclusion(scores, take_all, PoissonPPS(mixture, floor), tail_budget,
    top_fraction, alive)`` into ``pi``; returns :data:`ROW_OK` or :data:`ROW_REFUSED`.

    scores : float64 (end,), the row's scores over ``[0, end)``
    take_all : bool (end,), the take-all stratum
    first_alive : int, positions before it are out of the cache (a sliding layer's window;
        0: all alive), ``alive = arange(end) >= first_alive``
    tail_budget : int, expected tail tokens kept (top-h included)
    top_fraction, mixture, floor : float, the score's top share and the design's parameters
    pi : float64 (end,), receives the inclusion probabilities
    """
    end = scores.size
    tail = np.empty(end, np.int64)
    nt = 0
    for p in range(end):
        pi[p] = 1.0
        if not take_all[p]:
            if p >= first_alive:
                tail[nt] = p
                nt += 1
            else:
                pi[p] = 0.0
    n = min(tail_budget, nt)
    if n >= nt:
        return ROW_OK
    if n <= 0:
        for i in range(nt):
            pi[tail[i]] = 0.0
        return ROW_OK
    x = np.empty(nt)
    for i in range(nt):
        x[i] = scores[tail[i]]
        if not (np.isfinite(x[i]) and x[i] >= 0.0):
            return ROW_REFUSED  # the Python path decides (and raises)
    h = int(np.rint(top_fraction * n))  # Python's round: half to even
    if h > 0:
        nt = _drop_top_later(x, tail, h)
        x = x[:nt]
        n -= h
        if n <= 0:
            for i in range(nt):
                pi[tail[i]] = 0.0
            return ROW_OK
        if n >= nt:
            return ROW_OK
    # _usable_scores: fewer positive scores than n cannot reach n; lift the zeros.
    positive = 0
    for i in range(nt):
        if x[i] > 0:
            positive += 1
    if positive < n:
        top = x[0]
        for i in range(1, nt):
            if x[i] > top:
                top = x[i]
        for i in range(nt):
            x[i] = 1.0 if top <= 0 else max(x[i], 1e-12 * top)
    out = np.empty(nt)
    if not _poisson_pi(x, float(n), mixture, floor, out):
        return ROW_REFUSED
    for i in range(nt):
        pi[tail[i]] = out[i]
    return ROW_OK


@nb.njit(cache=True)
def _row_job(r, scores, offsets, take_all, first_alive, tail_budget, top_fraction, mixture,
             floor, pi, status):
    a, b = offsets[r], offsets[r + 1]
    status[r] = poisson_row(scores[a:b], take_all[a:b], first_alive[r], tail_budget[r],
                            top_fraction, mixture, floor, pi[a:b])


@nb.njit(cache=True, parallel=True)
def _rows_par(scores, offsets, take_all, first_alive, tail_budget, top_fraction, mixture, floor,
              pi, status):
    for r in nb.prange(offsets.size - 1):
        _row_job(r, scores, offsets, take_all, first_alive, tail_budget, top_fraction, mixture,
                 floor, pi, status)


@nb.njit(cache=True)
def _rows_ser(scores, offsets, take_all, first_alive, tail_budget, top_fraction, mixture, floor,
              pi, status):
    for r in range(offsets.size - 1):
        _row_job(r, scores, offsets, take_all, first_alive, tail_budget, top_fraction, mixture,
                 floor, pi, status)


def poisson_rows(scores: np.ndarray, offsets: np.ndarray, take_all: np.ndarray,
                 first_alive: np.ndarray, tail_budget: np.ndarray, top_fraction: float,
                 mixture: float, floor: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`poisson_row` of every row; rows are packed one after the other.

    Parameters
    ----------
    scores : ndarray of float64, shape (total,)
        Row ``r``'s scores are ``scores[offsets[r]:offsets[r + 1]]``.
    offsets : ndarray of int64, shape (rows + 1,)
    take_all : ndarray of bool, shape (total,)
    first_alive, tail_budget : ndarray of int64, shape (rows,)
    top_fraction, mixture, floor : float

    Returns
    -------
    pi : ndarray of float64, shape (total,)
    status : ndarray of int64, shape (rows,)
        :data:`ROW_OK`, or :data:`ROW_REFUSED` where ``pi`` was not written.
    """
    pi = np.empty(scores.size)
    status = np.empty(offsets.size - 1, np.int64)
    fn = _rows_ser if scores.size < SERIAL_BELOW else _rows_par
    fn(scores, offsets, take_all, first_alive, tail_budget, float(top_fraction),
       float(mixture), float(floor), pi, status)
    return pi, status
