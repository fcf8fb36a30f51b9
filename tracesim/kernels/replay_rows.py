"""Per-row reductions of the replay kernel (:mod:`tracesim.kernels.replay`).

A *row* is one (event query, group head) of a unit; its weights ``w`` are the Hájek weights
``E / pi`` of the kept tail tokens in position order, of which the query sees the first ``n``.
The sums are reassociated (``fastmath`` reassoc/contract) so that LLVM vectorises them; the
order is fixed at compile time, so results do not depend on threads or iteration order.

No summing loop also stores. LLVM vectorises a loop that writes one array while reading others
behind a run-time test that the output lies beyond a vector's reach of every input, and runs
the scalar loop when it does not: two arrays that malloc happened to place within a few hundred
bytes of each other (small rows of a unit are) took the sequential sum, others the vectorised
one, and the last bits of the certificate depended on the heap (seen on an AVX-512 machine,
where the reach is 32 doubles). A loop that only reads needs no such test; each row is written
by a loop of its own, which adds no sum, so the scalar and vector paths of that loop agree.
"""

from __future__ import annotations

import numba as nb
import numpy as np


@nb.njit(cache=True, fastmath={"reassoc", "contract"})
def row_sums(w, piv, n):
    """``(sum w exp-mass, sum w, sum w^2)`` over the first ``n`` weights of a row."""
    km = 0.0
    sw = 0.0
    sw2 = 0.0
    for j in range(n):
        x = np.float64(w[j])
        km += x * piv[j]
        sw += x
        sw2 += x * x
    return km, sw, sw2


@nb.njit(cache=True, fastmath={"reassoc", "contract"})
def tail_sums(w, cw, vnk, vqd, n, use_os, wd):
    """Row ``wd = (1-pi) w^2`` of the certificate's GEMM and its sums ``sum wd``,
    ``sum wd |v|^2`` and (output space) ``sum wd v^T Gamma_aa v``."""
    for j in range(n):
        x = np.float64(w[j])
        wd[j] = cw[j] * x * x
    # The sums recompute the row in float64 (``wd`` is float32 in the float32 mode) in loops
    # that only read (see the module's note on stores).
    s_c = 0.0
    s_q = 0.0
    s_qg = 0.0
    # Two loops rather than a test inside one: without the output space ``vqd`` is empty, and
    # the loop that runs by default stays a plain two-accumulator reduction.
    if use_os:
        for j in range(n):
            x = np.float64(w[j])
            v = cw[j] * x * x
            s_c += v
            s_q += v * vnk[j]
            s_qg += v * vqd[j]
    else:
        for j in range(n):
            x = np.float64(w[j])
            v = cw[j] * x * x
            s_c += v
            s_q += v * vnk[j]
    return s_c, s_q, s_qg


@nb.njit(cache=True, fastmath={"reassoc", "contract"})
def cross_sums(wa, wb, cw, vq, n, wx):
    """Row ``wx = (1-pi) w_a w_b`` of a head pair and its sums ``sum wx``,
    ``sum wx v^T Gamma_ab v`` (the row stored and summed in separate loops, as
    :func:`tail_sums`)."""
    for j in range(n):
        wx[j] = cw[j] * np.float64(wa[j]) * np.float64(wb[j])
    s0 = 0.0
    s1 = 0.0
    for j in range(n):
        v = cw[j] * np.float64(wa[j]) * np.float64(wb[j])
        s0 += v
        s1 += v * vq[j]
    return s0, s1


@nb.njit(cache=True)
def trace_sq(w, z, cw, Vk, est, mu, kept_idx, mt, t, fixed_var, mr):
    """``tr(V_hat^2)`` for one row via the d x d matrix (optional; O(m d^2))."""
    d = Vk.shape[1]
    Zt = np.zeros((d, mt))
    Zr = np.zeros((mt, d))
    for j in range(mt):
        if kept_idx[j] > t:
            continue
        s = np.sqrt(cw[j])
        a = w[j] / z
        for k in range(d):
            val = s * (a * (Vk[j, k] - est[k]) - (mu[k] if fixed_var else 0.0))
            Zr[j, k] = val
            Zt[k, j] = val
    Vm = np.dot(Zt, Zr)
    infl = 1.0
    if fixed_var:
        infl = mr / (mr - 1.0) if mr > 1.0 else 0.0
    acc = 0.0
    for i in range(d):
        for k in range(d):
            acc += Vm[i, k] * Vm[i, k]
    return acc * infl * infl
