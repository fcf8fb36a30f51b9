"""The per-step unit's estimate and certificate products, four kept tokens at a time.

:func:`tracesim.kernels.replay_fused.fused_products` adds every kept value row into the
accumulators ``X`` (estimate, ``R x d``) and ``TD`` (certificate, ``R x 2d``) one token at a
time. Those accumulators do not fit in registers, so each token costs a load and a store of
every accumulator entry (``3 R d`` of each): the loop is bound by that memory traffic, not by
its multiply-adds. Here four tokens are added per load and store of an accumulator entry (the
four value rows are read in place, from L1 after the first row of the unit), which cuts that
traffic by four; the multiply-adds are the same.

Each entry is a float sum over the kept tokens in gather order, in blocks of four summed as
``(a0 v0 + a1 v1) + (a2 v2 + a3 v3)`` then the remaining tokens one by one: a fixed order,
so results do not depend on threads or iteration order. It agrees with the token-by-token sum
(and the BLAS product) to rounding (``tests/test_fused_tiles.py``).
"""

from __future__ import annotations

import numba as nb
import numpy as np

__all__ = ["tiled_estimate", "tiled_products"]


@nb.njit(cache=True, inline="always")
def _tiled(Vg, kept_idx, m, We, Wd, D):
    nx = We.shape[0]
    X = np.zeros((nx, D), Vg.dtype)
    TD = np.zeros((nx, 2 * D), Vg.dtype)
    m4 = m - m % 4
    for j in range(0, m4, 4):
        p0 = kept_idx[j]
        p1 = kept_idx[j + 1]
        p2 = kept_idx[j + 2]
        p3 = kept_idx[j + 3]
        for r in range(nx):
            a0 = We[r, j]
            a1 = We[r, j + 1]
            a2 = We[r, j + 2]
            a3 = We[r, j + 3]
            b0 = Wd[r, j]
            b1 = Wd[r, j + 1]
            b2 = Wd[r, j + 2]
            b3 = Wd[r, j + 3]
            for k in range(D):
                v0 = Vg[p0, k]
                v1 = Vg[p1, k]
                v2 = Vg[p2, k]
                v3 = Vg[p3, k]
                X[r, k] += (a0 * v0 + a1 * v1) + (a2 * v2 + a3 * v3)
                TD[r, k] += (b0 * v0 + b1 * v1) + (b2 * v2 + b3 * v3)
                TD[r, D + k] += ((b0 * (v0 * v0) + b1 * (v1 * v1))
                                 + (b2 * (v2 * v2) + b3 * (v3 * v3)))
    for j in range(m4, m):
        p = kept_idx[j]
        for r in range(nx):
            a = We[r, j]
            b = Wd[r, j]
            for k in range(D):
                v = Vg[p, k]
                X[r, k] += a * v
                TD[r, k] += b * v
                TD[r, D + k] += b * (v * v)
    return X, TD


@nb.njit(cache=True)
def tiled_products(Vg, kept_idx, m, We, Wd):
    """``X = We[:, :m] V_kept[:m]`` and ``TD = Wd [V, V^2]_kept[:m]``, with
    ``V_kept[j] = Vg[kept_idx[j]]``, four tokens per accumulator pass.

    Vg : float (P, d), the KV head's values
    kept_idx : int64 (>= m,), the kept positions in gather order
    m : int, the tokens added (every one a tail token: the certificate's columns are the
        estimate's)
    We, Wd : float (R, >= m), the Hájek weights and the certificate's ``(1 - pi) w^2`` rows
        (the same rows)

    Returns ``(X (R, d), TD (R, 2 d))`` in the dtype of ``Vg``. ``d`` = 64 and 128 are
    compile-time constants of the loops (vectorised by LLVM), other ``d`` the run-time loop;
    every variant adds in the same order.
    """
    d = Vg.shape[1]
    if d == 64:
        return _tiled(Vg, kept_idx, m, We, Wd, 64)
    if d == 128:
        return _tiled(Vg, kept_idx, m, We, Wd, 128)
    return _tiled(Vg, kept_idx, m, We, Wd, d)


@nb.njit(cache=True, inline="always")
def _tiled_rows(Vg, kept_idx, m, W, D):
    X = np.zeros((W.shape[0], D), Vg.dtype)
    m4 = m - m % 4
    for j in range(0, m4, 4):
        p0 = kept_idx[j]
        p1 = kept_idx[j + 1]
        p2 = kept_idx[j + 2]
        p3 = kept_idx[j + 3]
        for r in range(W.shape[0]):
            a0 = W[r, j]
            a1 = W[r, j + 1]
            a2 = W[r, j + 2]
            a3 = W[r, j + 3]
            for k in range(D):
                X[r, k] += (a0 * Vg[p0, k] + a1 * Vg[p1, k]) + (a2 * Vg[p2, k] + a3 * Vg[p3, k])
    for j in range(m4, m):
        p = kept_idx[j]
        for r in range(W.shape[0]):
            a = W[r, j]
            for k in range(D):
                X[r, k] += a * Vg[p, k]
    return X


@nb.njit(cache=True)
def tiled_estimate(Vg, kept_idx, m, W):
    """``W[:, :m] V_kept[:m]`` (R, d) in the order of :func:`tiled_products` (the
    output-space cross rows and the fixed-size centring rows of a fused unit)."""
    d = Vg.shape[1]
    if d == 64:
        return _tiled_rows(Vg, kept_idx, m, W, 64)
    if d == 128:
        return _tiled_rows(Vg, kept_idx, m, W, 128)
    return _tiled_rows(Vg, kept_idx, m, W, d)
