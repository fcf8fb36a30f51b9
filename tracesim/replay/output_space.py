"""Output-space constants of a layer: the Gram blocks of ``o_proj`` per GQA head pair, the
packed triangular factor for the layer error, and each token's quadratic forms.

They depend on ``o_proj`` (and the values) only, so :class:`tracesim.replay.engine.ReplaySetup`
computes them once per layer layout and every policy and seed shares them (``docs/replay.md``,
"Output space").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracesim.kernels.replay_output_space import quadratic_forms

__all__ = ["LAYER_ERROR_BLOCK", "GramBlocks", "gram_blocks", "token_quadratic_forms"]


def _pairs(G: int) -> tuple[list[tuple[int, int]], np.ndarray]:
    """Head pairs of a GQA group (diagonal first, then ``a < b``) and their (G, G) index."""
    pairs = [(a, a) for a in range(G)] + [(a, b) for a in range(G) for b in range(a + 1, G)]
    pidx = np.zeros((G, G), dtype=np.int64)
    for i, (a, b) in enumerate(pairs):
        pidx[a, b] = pidx[b, a] = i
    return pairs, pidx


@dataclass(frozen=True)
class GramBlocks:
    """Output-space constants of one layer (they depend on ``o_proj`` only).

    Attributes
    ----------
    gam : ndarray, shape (n_kv, n_pairs, d, d)
        ``W_a^T W_b`` for every head pair of every GQA group (``W_h``: the ``(hidden, d)``
        columns of ``o_proj`` that head h writes).
    gblk : ndarray, shape (n_kv, G, d, G * d)
        Row block b of each group's ``W_g^T W_g`` (``[W_b^T W_0 ... W_b^T W_{G-1}]``).
    rpack, roff, rstart : ndarray
        The triangular factor ``R`` of ``o_proj = Q R`` (``min(hidden, H d) x H d``) cut into
        row blocks of :data:`LAYER_ERROR_BLOCK` rows starting at ``rstart``; block c is
        ``R[r0:r1, r0:]`` (its non-zero columns), flattened at ``rpack[roff[c]:roff[c+1]]``.
        ``|o_proj e|^2 = |R e|^2`` for any ``e``, at about half the cost of ``o_proj e``.
    """

    gam: np.ndarray
    gblk: np.ndarray
    rpack: np.ndarray
    roff: np.ndarray
    rstart: np.ndarray


#: Rows of the triangular factor per layer-error GEMM (measured best of 32..576 at H d = 576).
LAYER_ERROR_BLOCK = 64


def gram_blocks(o_proj: np.ndarray, n_kv: int, G: int, d: int) -> GramBlocks:
    """One GEMM ``W_g^T W_g`` per GQA group, cut into the (d, d) blocks of its head pairs, and
    the packed triangular factor of ``o_proj`` for the layer error."""
    W = np.asarray(o_proj, dtype=np.float64)
    if W.shape[1] != n_kv * G * d:
        raise ValueError(f"o_proj has {W.shape[1]} columns, expected {n_kv * G * d}")
    pairs, _ = _pairs(G)
    gam = np.empty((n_kv, len(pairs), d, d))
    gblk = np.empty((n_kv, G, d, G * d))
    for g in range(n_kv):
        Wg = W[:, g * G * d:(g + 1) * G * d]
        full = Wg.T @ Wg
        gblk[g] = full.reshape(G, d, G * d)
        for i, (a, b) in enumerate(pairs):
            gam[g, i] = full[a * d:(a + 1) * d, b * d:(b + 1) * d]
    R = np.linalg.qr(W, mode="r")  # (min(hidden, H d), H d), upper triangular (trapezoidal)
    k = R.shape[0]
    rstart = np.array(list(range(0, k, LAYER_ERROR_BLOCK)) + [k], dtype=np.int64)
    blocks = [np.ascontiguousarray(R[a:b, a:]).ravel() for a, b in zip(rstart[:-1], rstart[1:],
                                                                         strict=True)]
    roff = np.cumsum([0] + [x.size for x in blocks]).astype(np.int64)
    return GramBlocks(gam=gam, gblk=gblk, rpack=np.concatenate(blocks), roff=roff,
                      rstart=rstart)


def token_quadratic_forms(values: np.ndarray, gam: np.ndarray) -> np.ndarray:
    """``vq[g, i, p] = v_p^T Gamma_{g,i} v_p``, shape (n_kv, n_pairs, P): one GEMM per group
    and chunk of positions against the pair blocks side by side, then the row dot products in
    compiled code (:func:`tracesim.kernels.replay_output_space.quadratic_forms`)."""
    n_kv, P, d = values.shape
    npairs = gam.shape[1]
    gcat = np.ascontiguousarray(gam.transpose(0, 2, 1, 3).reshape(n_kv, d, npairs * d))
    vq = np.empty((n_kv, npairs, P))
    quadratic_forms(np.ascontiguousarray(values, dtype=np.float64), gcat, vq)
    return vq
