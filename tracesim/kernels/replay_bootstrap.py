"""Compiled Poisson bootstrap of the replay: ``boot_cov`` and ``boot_cert2`` per row.

Run only when ``ReplayOptions.bootstrap = B > 0``, after :func:`tracesim.kernels.replay.
replay_kernel` on the same chunk of queries (that kernel is not touched by this option). For
one (iteration, KV head, event) unit it gathers the kept set exactly as the replay kernel does
(:func:`tracesim.kernels.replay_events.event_kept`, the same permanent or fresh per-step
uniforms), draws the multiplier (1 with probability pi, else Poisson(1)) of every kept tail
token and replicate from
:func:`tracesim.prn.bootstrap_count` (take-all tokens keep weight 1) and, per row (event query,
group head), forms the replicate estimates

    o_r = (sum_tail N_rj w_j v_j + sum_take-all w_j v_j) / (sum_tail N_rj w_j + sum_take-all w_j)

with the Hájek weights ``w = E / pi`` (one GEMM of the ``(B, n)`` weighted multipliers with the
kept values per row). The bootstrap variance of coordinate k is ``mean_r (o_r,k - o_hat_k)^2``
(a replicate whose multipliers drop every token the query sees counts as no deviation: its
estimate is the limit ``o_hat``). Everything is float64 whatever the replay precision; each
iteration writes only its own slots and calls BLAS single-threaded (the caller sets the limit),
so results do not depend on the number of threads.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from tracesim.kernels.replay_events import event_kept
from tracesim.prn import bootstrap_count

# Fields of ``boot[iteration, head, query, :]``.
B_COV, B_CERT2 = 0, 1
N_BOOT_FIELDS = 2


@nb.njit(cache=True)
def _unit(layer, qrows, g, G, kept_idx, mt, m, corrected, pi_row, mult, z_wald, out_it):
    """Bootstrap every (query, head) row of one unit into ``out_it[h, q]``."""
    E, V, truth, qpos = layer.E, layer.V, layer.truth, layer.qpos
    d = V.shape[2]
    n_rep = mult.shape[0]
    inv = np.empty(m)
    Vk = np.empty((m, d))
    for j in range(m):
        p = kept_idx[j]
        inv[j] = 1.0 / pi_row[p] if corrected else 1.0
        for k in range(d):
            Vk[j, k] = np.float64(V[g, p, k])
    w = np.empty(m)
    est = np.empty(d)
    xta = np.empty(d)
    var = np.empty(d)
    for a in range(qrows.size):
        q = qrows[a]
        t = qpos[q]
        # Tail tokens are in position order: the query sees the first nv of them.
        nv = np.searchsorted(kept_idx[:mt], t, side="right")
        for hh in range(G):
            h = g * G + hh
            for j in range(m):
                w[j] = np.float64(E[h, q, kept_idx[j]]) * inv[j]
            zta = np.float64(layer.zsink[h, q])  # the sink: take-all, value 0 (0.0 without)
            for k in range(d):
                xta[k] = 0.0
            for j in range(mt, m):  # take-all tokens after the query have E = 0
                zta += w[j]
                for k in range(d):
                    xta[k] += w[j] * Vk[j, k]
            zt = 0.0
            for j in range(nv):
                zt += w[j]
            for k in range(d):
                s = 0.0
                for j in range(nv):
                    s += w[j] * Vk[j, k]
                est[k] = (s + xta[k]) / (zt + zta)
                var[k] = 0.0
            if nv > 0:
                A = np.empty((n_rep, nv))
                for r in range(n_rep):
                    for j in range(nv):
                        A[r, j] = mult[r, j] * w[j]
                num = np.dot(A, Vk[:nv])
                for r in range(n_rep):
                    den = zta
                    for j in range(nv):
                        den += A[r, j]
                    if den == 0.0:
                        continue
                    for k in range(d):
                        dev = (num[r, k] + xta[k]) / den - est[k]
                        var[k] += dev * dev
            cov = 0.0
            tr = 0.0
            for k in range(d):
                vk = var[k] / n_rep
                tr += vk
                if abs(est[k] - truth[h, q, k]) <= z_wald * np.sqrt(vk):
                    cov += 1.0
            out_it[h, q, B_COV] = cov / d
            out_it[h, q, B_CERT2] = tr


@nb.njit(cache=True, parallel=True)
def bootstrap_kernel(layer, incl, its, z_wald, n_replicates, boot):
    """Poisson bootstrap of every certified iteration over one chunk of a layer's queries.

    Parameters
    ----------
    layer : ChunkTensors
        As for :func:`tracesim.kernels.replay.replay_kernel`.
    incl : InclusionArrays
        As for the replay kernel.
    its : IterationTables
        As for the replay kernel.
    z_wald : float
        Normal quantile ``z_{1 - alpha/2}`` (the Wald column's).
    n_replicates : int
        Bootstrap replicates B (>= 2).
    boot : ndarray of float64, shape (n_iter, H, NQ, N_BOOT_FIELDS)
        Written: the row's coverage fraction (``B_COV``) and bootstrap variance trace
        (``B_CERT2``, value units^2); NaN for iterations of uncertified policies.
    """
    E, V = layer.E, layer.V
    pi, ev_qptr, ev_q = incl.pi, incl.ev_qptr, incl.ev_q
    slot_ev, ev_stream = incl.slot_ev, incl.ev_stream
    it_cfg, it_seed, it_slot, it_kslot = its.it_cfg, its.it_seed, its.it_slot, its.it_kslot
    flags, u, seed_values, layer_index = its.flags, its.u, its.seed_values, its.layer
    H = E.shape[0]
    P = E.shape[2]
    n_kv = V.shape[0]
    G = H // n_kv
    for it in nb.prange(it_cfg.size):
        c = it_cfg[it]
        if flags[c, 1] != 1:
            for h in range(H):
                for q in range(boot.shape[2]):
                    boot[it, h, q, B_COV] = np.nan
                    boot[it, h, q, B_CERT2] = np.nan
            continue
        corrected = flags[c, 0] == 1
        s = it_seed[it]
        slot = it_slot[it]
        ks = it_kslot[it]
        keptflag = np.empty(P, dtype=np.bool_)
        kept_idx = np.empty(P, dtype=np.int64)
        ufresh = np.empty(P)
        for g in range(n_kv):
            for e in range(slot_ev[slot], slot_ev[slot + 1]):
                qrows = ev_q[ev_qptr[e]:ev_qptr[e + 1]]
                if qrows.size == 0:
                    continue
                mt, m, _, _ = event_kept(incl, e, g, s, ks, u, seed_values, layer_index,
                                         keptflag, kept_idx, ufresh)
                sample_stream = max(ev_stream[e], 0)
                mult = np.empty((n_replicates, mt))
                for r in range(n_replicates):
                    for j in range(mt):
                        mult[r, j] = bootstrap_count(seed_values[s], layer_index, g,
                                                     kept_idx[j], r, sample_stream,
                                                     pi[e, g, kept_idx[j]])
                _unit(layer, qrows, g, G, kept_idx, mt, m, corrected, pi[e, g], mult, z_wald,
                      boot[it])
