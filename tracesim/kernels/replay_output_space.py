"""Output-space (GQA) terms of the replay: the group certificate and the layer error.

Both work in the head dimension: the certificate expands ``|sum_h a_h W_h (v - o_h)|^2``
with the Gram blocks ``W_a^T W_b`` of ``o_proj``, and the layer error ``|W_O (o_hat - o)|^2``
is ``|R (o_hat - o)|^2`` with ``R`` the triangular factor of ``W_O``, so no vector of the
hidden size is formed. Called by :func:`tracesim.kernels.replay.replay_kernel`.
"""

from __future__ import annotations

import numba as nb
import numpy as np


@nb.njit(cache=True)
def group_variance(qrows, G, npx, est3, Z, s_diag, q_diag, TD, XF, sx, gblk, lcert):
    """Add ``sum_{i in S} (1-pi_i) |sum_h a_hi W_h (v_i - o_h)|^2`` of each block query to
    ``lcert``.

    The Gram products ``Gamma_ab o_b`` of every ordered head pair come from one GEMM per head
    b, ``o_b^T [Gamma_b0 ... Gamma_b,G-1]`` (``gblk[b]``: row block b of the group's
    ``W_g^T W_g``). Rows ``r = a * G + h`` are (block query a, group head h).

    Parameters
    ----------
    qrows : ndarray of int64, shape (nqe,)
        The block's queries (indices into ``lcert``).
    G : int
        Query heads of the group.
    npx : int
        Cross pairs of the group, ``G (G - 1) / 2``.
    est3 : ndarray of float64, shape (G, nqe, d)
        Estimates ``o_hat`` by head and block query.
    Z : ndarray of float64, shape (nqe * G,)
        Hájek normalisers of the rows.
    s_diag, q_diag : ndarray of float64, shape (nqe * G,)
        Per row: ``sum (1-pi) w^2`` and ``sum (1-pi) w^2 v^T Gamma_hh v`` over the kept tail.
    TD : ndarray of float, shape (nqe * G, 2 d)
        Per row, first ``d`` columns: ``sum (1-pi) w^2 v``.
    XF : ndarray of float, shape (>= nqe * npx, d)
        Rows ``a * npx + x``: ``sum (1-pi) w_a w_b v`` of cross pair ``x``.
    sx : ndarray of float64, shape (nqe * npx, 2)
        Per cross pair row: ``sum (1-pi) w_a w_b`` and ``sum (1-pi) w_a w_b v^T Gamma_ab v``.
    gblk : ndarray of float64, shape (G, d, G * d)
        Row blocks of the group's ``W_g^T W_g``.
    lcert : ndarray of float64, shape (NQ,)
        Accumulated in place.
    """
    nqe = qrows.size
    d = est3.shape[2]
    pg = np.empty((G, nqe, G * d))
    for hb in range(G):
        pg[hb] = np.dot(est3[hb], gblk[hb])  # pg[b][a, ha*d + k] = (Gamma_{ha,b} o_b)_k
    x = G  # cross pairs are stored after the G diagonal pairs
    for ha in range(G):
        for hb in range(ha, G):
            cross = ha != hb
            mult = 2.0 if cross else 1.0
            ca = ha * d  # (Gamma_ab o_b) in pg[hb]; (Gamma_ab^T o_a) = (Gamma_ba o_a) in pg[ha]
            cb = hb * d
            for a in range(nqe):
                ra = a * G + ha
                rb = a * G + hb
                if cross:
                    s_ab = sx[a * npx + x - G, 0]
                    term = sx[a * npx + x - G, 1]
                else:
                    s_ab = s_diag[ra]
                    term = q_diag[ra]
                quad = 0.0
                xr = a * npx + x - G
                for k in range(d):
                    tv = XF[xr, k] if cross else TD[ra, k]
                    b1 = pg[hb, a, ca + k]
                    term -= tv * (b1 + pg[ha, a, cb + k])
                    quad += est3[ha, a, k] * b1
                term += s_ab * quad
                lcert[qrows[a]] += mult * term / (Z[ra] * Z[rb])
            if cross:
                x += 1


@nb.njit(cache=True)
def layer_error(errT, rpack, roff, rstart, lerr):
    """``lerr[q] = |W_O err_q|^2 = |R err_q|^2`` with ``R`` the triangular factor of
    ``W_O = Q R``: one GEMM per row block ``c`` of ``R`` over its non-zero columns ``[r0, Hd)``
    (about half the multiply-adds of ``W_O err``). ``errT`` (Hd, NQ); ``rpack`` holds the
    blocks ``R[r0:r1, r0:]`` row-major at offsets ``roff``, row starts ``rstart``."""
    Hd, NQ = errT.shape
    flat = errT.ravel()
    for q in range(NQ):
        lerr[q] = 0.0
    for c in range(rstart.size - 1):
        r0 = rstart[c]
        r1 = rstart[c + 1]
        Rc = rpack[roff[c]:roff[c + 1]].reshape((r1 - r0, Hd - r0))
        Y = np.dot(Rc, flat[r0 * NQ:].reshape((Hd - r0, NQ)))
        for i in range(r1 - r0):
            for q in range(NQ):
                y = np.float64(Y[i, q])
                lerr[q] += y * y


#: Positions per GEMM of :func:`quadratic_forms` (its product block, positions x pairs x d
#: floats, stays in the L2 cache).
QUADRATIC_CHUNK = 256


@nb.njit(cache=True, fastmath={"reassoc", "contract"})
def _quadratic_chunk(values, gcat, vq, job):
    """Job ``job`` of :func:`quadratic_forms`: group ``job // chunks``, positions of chunk
    ``job % chunks``."""
    n_kv, P, d = values.shape
    npairs = vq.shape[1]
    chunks = (P + QUADRATIC_CHUNK - 1) // QUADRATIC_CHUNK
    g = job // chunks
    p0 = (job % chunks) * QUADRATIC_CHUNK
    p1 = min(P, p0 + QUADRATIC_CHUNK)
    Vc = values[g, p0:p1]
    Y = np.dot(Vc, gcat[g])
    for p in range(p1 - p0):
        for i in range(npairs):
            acc = 0.0
            for k in range(d):
                acc += Y[p, i * d + k] * Vc[p, k]
            vq[g, i, p0 + p] = acc


@nb.njit(cache=True, parallel=True)
def quadratic_forms(values, gcat, vq):
    """``vq[g, i, p] = v_p^T Gamma_{g,i} v_p`` for every head pair ``i`` of every group ``g``.

    One GEMM per group and chunk of :data:`QUADRATIC_CHUNK` positions, ``V_c [Gamma_0 ...
    Gamma_{n-1}]`` (single-threaded BLAS: the caller sets the limit), then each row's dot
    products with its value in a fixed order; the (group, chunk) jobs run in parallel and each
    writes only its own slice, so the result is the same on any thread count.

    Parameters
    ----------
    values : ndarray of float64, shape (n_kv, P, d)
    gcat : ndarray of float64, shape (n_kv, d, n_pairs * d)
        The pair blocks side by side, ``gcat[g][:, i d:(i+1) d] = Gamma_{g,i}``.
    vq : ndarray of float64, shape (n_kv, n_pairs, P)
        Written.
    """
    n_kv, P = values.shape[0], values.shape[1]
    chunks = (P + QUADRATIC_CHUNK - 1) // QUADRATIC_CHUNK
    for job in nb.prange(n_kv * chunks):
        _quadratic_chunk(values, gcat, vq, job)
