"""The value products of a replay unit with few rows, in one pass over the kept tokens.

A one-shot event is evaluated by all its queries at once: its unit has ``R = queries x G`` rows
(192 on the benchmark layer) and the products ``X = We V_kept``, ``TD = Wd [V, V^2]_kept`` and
``XF = Wxf V_kept`` are real GEMMs, for which gathering the kept values into a contiguous
block and calling BLAS pays. A per-step event has one query: ``R = G`` rows (3 on SmolLM2), and
the same gather-then-GEMM spends most of its time copying ``V_kept`` and ``V_kept^2`` (profiled
in ``docs/replay.md``, "Where the per-step time goes"). Here each kept value row is read once,
in place, and added into every product while it is in cache.

Each entry is a float sum over the kept tokens in their gather order (no reassociation: the
order is fixed, so results do not depend on threads or iteration order); it differs from the
BLAS product in the last bits only.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from tracesim.kernels.fused_tiles import tiled_estimate, tiled_products

#: Units with at most this many rows (event queries x group heads) take the fused path; larger
#: ones gather the kept values and call BLAS. Measured break-even (one thread, d = 64, 230 kept
#: tail tokens, estimate and certificate products): fused 2.2x faster at 3 rows, even at 8,
#: 1.5x slower at 16; the output space adds G (G - 1) / 2 cross rows per query, so the fused
#: path is kept to per-step units of GQA groups up to 4 heads (SmolLM2 3, the llama shape 4).
FUSED_ROWS = 4  # a compile-time constant of replay_unit.py: its numba cache goes by that file


@nb.njit(cache=True)
def weight_rows(E, qrows, g, G, kept_idx, m, inv, like):
    """The Hájek weights ``We (R, m)`` (dtype of ``like``) and normalisers ``Z (R,)`` of
    :func:`tracesim.kernels.replay_events.estimate_block`, without its value gather and GEMM."""
    nqe = qrows.size
    R = nqe * G
    We = np.empty((R, m), like.dtype)
    Z = np.zeros(R)
    for a in range(nqe):
        q = qrows[a]
        for hh in range(G):
            h = g * G + hh
            r = a * G + hh
            z = 0.0
            for j in range(m):
                w = E[h, q, kept_idx[j]] * inv[j]
                We[r, j] = w
                z += w
            Z[r] = z
    return We, Z


@nb.njit(cache=True, inline="always")
def _products(Vg, kept_idx, m, mt, We, Wd, Wxf, D):
    nx, nd, nf = We.shape[0], Wd.shape[0], Wxf.shape[0]
    X = np.zeros((nx, D), Vg.dtype)
    TD = np.zeros((nd, 2 * D), Vg.dtype)
    XF = np.zeros((nf, D), Vg.dtype)
    # Plain element indexing (a row view per token costs more than the arithmetic here).
    for j in range(m):
        p = kept_idx[j]
        if j < mt and nd == nx:  # the certificate's rows are the estimate's rows
            for r in range(nx):
                w = We[r, j]
                w2 = Wd[r, j]
                for k in range(D):
                    vk = Vg[p, k]
                    X[r, k] += w * vk
                    TD[r, k] += w2 * vk
                    TD[r, D + k] += w2 * (vk * vk)
        else:
            for r in range(nx):
                w = We[r, j]
                for k in range(D):
                    X[r, k] += w * Vg[p, k]
            if j < mt:
                for r in range(nd):
                    w2 = Wd[r, j]
                    for k in range(D):
                        vk = Vg[p, k]
                        TD[r, k] += w2 * vk
                        TD[r, D + k] += w2 * (vk * vk)
        if j < mt:
            for r in range(nf):
                w = Wxf[r, j]
                for k in range(D):
                    XF[r, k] += w * Vg[p, k]
    return X, TD, XF


@nb.njit(cache=True)
def fused_products(Vg, kept_idx, m, mt, We, Wd, Wxf):
    """``X = We[:, :m] V_kept[:m]``, ``TD = Wd [V, V^2]_kept[:mt]`` (``TD[:, :d]`` and
    ``TD[:, d:]``) and ``XF = Wxf V_kept[:mt]``, with ``V_kept[j] = Vg[kept_idx[j]]``.

    ``Wd`` and ``Wxf`` may have no rows (no tail certificate, no cross pairs). Returns
    ``(X, TD, XF)`` in the dtype of ``Vg``. The head dimensions of the built-in models (64,
    128) are compile-time constants of the loops: LLVM then vectorises them, which it does not
    for a run-time ``d`` (measured 2x slower than with the constant); other ``d`` take the
    run-time loop. Every variant adds in the same order.
    """
    if m == mt and Wd.shape[0] == We.shape[0] > 0:
        # Every kept token a tail token and a certificate row per estimate row (a per-step
        # unit whose take-all part is the event's): four tokens per accumulator pass.
        X, TD = tiled_products(Vg, kept_idx, m, We, Wd)
        return X, TD, tiled_estimate(Vg, kept_idx, mt, Wxf)
    d = Vg.shape[1]
    if d == 64:
        return _products(Vg, kept_idx, m, mt, We, Wd, Wxf, 64)
    if d == 128:
        return _products(Vg, kept_idx, m, mt, We, Wd, Wxf, 128)
    return _products(Vg, kept_idx, m, mt, We, Wd, Wxf, d)
