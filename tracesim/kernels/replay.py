"""Compiled replay kernel: every (policy, seed) against one layer's shared logits.

The engine computes ``E[h, q, p] = exp(s_hqp - max_p s_hqp)`` (causal zeros) once per layer, so
a policy's Hájek weight of a kept token is just ``E / pi``: no logits and no exponentials are
recomputed per policy or seed. For one (iteration, KV head, event) *unit* the kernel

1. gathers the kept tokens (tail ``pi < 1`` first, then take-all, each in position order),
2. builds the weight matrices of the group's heads and the event's queries (rows) over kept
   tokens (columns): ``w``, ``(1-pi) w^2`` and, for the output-space certificate,
   ``(1-pi) w_a w_b`` across the group's head pairs,
3. multiplies them with the kept values (BLAS dgemm, one thread per iteration), and
4. finishes each row: estimate, error, certificates, coverage, oracle diagnostics.

Certificates use the running sums ``S2 - 2 o.S1 + |o|^2 S0`` (see ``tracesim.estimators``);
the output-space certificate expands ``|sum_h a_h W_h (v - o_h)|^2`` with the Gram blocks
``W_a^T W_b`` so no per-token vector of the hidden size is ever formed.

Each iteration writes only its own output slots and calls BLAS single-threaded (the caller
sets the BLAS thread limit), so results are bit-identical for any number of numba threads and
any order of iterations.
"""

from __future__ import annotations

import numba as nb
import numpy as np

# Fields of ``out[iteration, head, query, :]``.
F_ERR2, F_REL, F_CERT2, F_CERT2_SMALL, F_TAIL, F_NEFF, F_WALD, F_WALD_T, F_TRV2 = range(9)
F_KEPT, F_EXPECTED, F_POP, F_OUT_MASS, F_OUT_MAX, F_EV_MASS, F_EV_MAX, F_EVENT = range(9, 17)
N_FIELDS = 17
# Fields of ``lout[iteration, query, :]`` (per layer, output space).
L_ERR2, L_CERT2 = 0, 1
N_LAYER_FIELDS = 2
# Row scalars.
_Z, _SC, _Q, _SW, _SW2, _SCW, _SC1, _MT, _QG = range(9)
_NS = 9


@nb.njit(cache=True)
def gather_kept(pi_row, u_row, kmask_row, use_mask, tau, keptflag, kept_idx):
    """Kept positions into ``kept_idx``: tail (pi < 1) first, then take-all, ascending.

    Returns ``(m_tail, m, kept_before_tau, expected_before_tau)``.
    """
    P = pi_row.size
    mt = 0
    for p in range(P):
        pv = pi_row[p]
        k = (kmask_row[p] != 0) if use_mask else (u_row[p] < pv)
        keptflag[p] = k
        if k and pv < 1.0:
            kept_idx[mt] = p
            mt += 1
    m = mt
    kb = 0
    ex = 0.0
    for p in range(P):
        if keptflag[p]:
            if pi_row[p] >= 1.0:
                kept_idx[m] = p
                m += 1
            if p < tau:
                kb += 1
        if p < tau:
            ex += pi_row[p]
    return mt, m, kb, ex


@nb.njit(cache=True)
def estimate_block(E, Vg, qrows, g, G, kept_idx, m, inv):
    """Hájek numerators and normalisers of the group's heads for the given queries.

    Returns ``(We (R, m), Vk (m, d), X (R, d), Z (R,))`` with row ``r = a * G + hh``. Both the
    truth and every policy go through this function, so ``full`` reproduces the truth bit for
    bit.
    """
    nqe = qrows.size
    d = Vg.shape[1]
    R = nqe * G
    Vk = np.empty((m, d))
    for j in range(m):
        p = kept_idx[j]
        for k in range(d):
            Vk[j, k] = Vg[p, k]
    We = np.empty((R, m))
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
    if R > 0 and m > 0:
        X = np.dot(We, Vk)
    else:
        X = np.zeros((R, d))
    return We, Vk, X, Z


@nb.njit(cache=True, parallel=True)
def truth_kernel(E, V, qrows, truth, zfull):
    """Full-cache outputs (H, NQ, d) and normalisers (H, NQ) through :func:`estimate_block`."""
    H = E.shape[0]
    n_kv, P, d = V.shape
    G = H // n_kv
    for g in nb.prange(n_kv):
        kept_idx = np.arange(P)
        inv = np.ones(P)
        We, Vk, X, Z = estimate_block(E, V[g], qrows, g, G, kept_idx, P, inv)
        for a in range(qrows.size):
            q = qrows[a]
            for hh in range(G):
                r = a * G + hh
                for k in range(d):
                    truth[g * G + hh, q, k] = X[r, k] / Z[r]
                zfull[g * G + hh, q] = Z[r]


@nb.njit(cache=True)
def _unit(E, zfull, Vg, V2g, vn2g, truth, qpos, qrows, g, G, pi_row, keptflag, kept_idx,
          mt, m, kb, ex, event, corrected, certify, fixed_var, z_wald, t_table, gam, vqg,
          pidx, use_os, want_trv2, out_it, err, lcert):
    nqe = qrows.size
    d = Vg.shape[1]
    R = nqe * G
    inv = np.empty(m)
    cw = np.empty(m)
    for j in range(m):
        pv = pi_row[kept_idx[j]]
        inv[j] = 1.0 / pv if corrected else 1.0
        cw[j] = 1.0 - pv if pv < 1.0 else 0.0
    We, Vk, X, Z = estimate_block(E, Vg, qrows, g, G, kept_idx, m, inv)
    sc = np.zeros((R, _NS))
    tail = certify and mt > 0
    npx = G * (G - 1) // 2 if use_os else 0
    Wd = np.empty((R if tail else 0, mt))
    Wf = np.empty((R if (tail and fixed_var) else 0, mt))
    Wx = np.empty((nqe * npx if tail else 0, mt))
    sx = np.zeros((nqe * npx, 2))
    for a in range(nqe):
        t = qpos[qrows[a]]
        for hh in range(G):
            r = a * G + hh
            sc[r, _Z] = Z[r]
            for j in range(mt):
                if kept_idx[j] > t:
                    if tail:
                        Wd[r, j] = 0.0
                        if fixed_var:
                            Wf[r, j] = 0.0
                    continue
                w = We[r, j]
                sc[r, _MT] += 1.0
                sc[r, _SW] += w
                sc[r, _SW2] += w * w
                if tail:
                    wd = cw[j] * w * w
                    Wd[r, j] = wd
                    sc[r, _SC] += wd
                    sc[r, _Q] += wd * vn2g[kept_idx[j]]
                    if use_os:
                        sc[r, _QG] += wd * vqg[pidx[hh, hh], kept_idx[j]]
                    if fixed_var:
                        Wf[r, j] = cw[j] * w
                        sc[r, _SCW] += cw[j] * w
                        sc[r, _SC1] += cw[j]
        if tail and use_os:
            x = 0
            for ha in range(G):
                for hb in range(ha + 1, G):
                    rx = a * npx + x
                    ra = a * G + ha
                    rb = a * G + hb
                    pq = pidx[ha, hb]
                    for j in range(mt):
                        wx = cw[j] * We[ra, j] * We[rb, j]
                        Wx[rx, j] = wx
                        sx[rx, 0] += wx
                        sx[rx, 1] += wx * vqg[pq, kept_idx[j]]
                    x += 1
    if tail:
        V2k = np.empty((mt, d))
        for j in range(mt):
            for k in range(d):
                V2k[j, k] = V2g[kept_idx[j], k]
        Vt = Vk[:mt]
        T = np.dot(Wd, Vt)
        D = np.dot(Wd, V2k)
        F = np.dot(Wf, Vt) if fixed_var else np.zeros((0, d))
        Tx = np.dot(Wx, Vt) if npx > 0 else np.zeros((0, d))
    else:
        T = np.zeros((0, d))
        D = T
        F = T
        Tx = T
    est = np.empty((G, d))
    diag = np.empty(d)
    mu = np.zeros(d)
    for a in range(nqe):
        q = qrows[a]
        t = qpos[q]
        for hh in range(G):
            h = g * G + hh
            r = a * G + hh
            o = out_it[h, q]
            e2 = 0.0
            n2 = 0.0
            for k in range(d):
                est[hh, k] = X[r, k] / Z[r]
                dk = est[hh, k] - truth[h, q, k]
                err[q, h * d + k] = dk
                e2 += dk * dk
                n2 += truth[h, q, k] * truth[h, q, k]
            o[F_ERR2] = e2
            o[F_REL] = np.sqrt(e2 / n2) if n2 > 0.0 else np.nan
            mr = sc[r, _MT]
            o[F_TAIL] = mr
            o[F_NEFF] = sc[r, _SW] ** 2 / sc[r, _SW2] if sc[r, _SW2] > 0.0 else 0.0
            o[F_KEPT] = kb
            o[F_EXPECTED] = ex
            o[F_EVENT] = event
            # Oracle diagnostics over the tokens the query would see in the full cache.
            pop = 0
            om = 0.0
            ox = 0.0
            em = 0.0
            ex_max = 0.0
            zf = zfull[h, q]
            for p in range(min(t + 1, pi_row.size)):
                pv = pi_row[p]
                if pv < 1.0:
                    pop += 1
                if not keptflag[p]:
                    w = E[h, q, p] / zf
                    if pv > 0.0:
                        om += w
                        ox = max(ox, w)
                    else:
                        em += w
                        ex_max = max(ex_max, w)
            o[F_POP] = pop
            o[F_OUT_MASS] = om
            o[F_OUT_MAX] = ox
            o[F_EV_MASS] = em
            o[F_EV_MAX] = ex_max
            if not certify:
                o[F_CERT2] = np.nan
                o[F_CERT2_SMALL] = np.nan
                o[F_WALD] = np.nan
                o[F_WALD_T] = np.nan
                o[F_TRV2] = np.nan
                continue
            tr = 0.0
            zz = Z[r] * Z[r]
            if tail and mr > 0:
                s0 = sc[r, _SC]
                on = 0.0
                for k in range(d):
                    on += est[hh, k] * est[hh, k]
                    tr -= 2.0 * est[hh, k] * T[r, k]
                    diag[k] = (D[r, k] - 2.0 * est[hh, k] * T[r, k]
                               + est[hh, k] * est[hh, k] * s0) / zz
                tr = (sc[r, _Q] + tr + on * s0) / zz
                if fixed_var:
                    # Rosén: centre a_i r_i on its (1-pi)-weighted mean, inflate by m/(m-1).
                    infl = mr / (mr - 1.0) if mr > 1.0 else 0.0
                    mu2 = 0.0
                    for k in range(d):
                        mu[k] = (F[r, k] - est[hh, k] * sc[r, _SCW]) / Z[r]
                        mu2 += mu[k] * mu[k]
                        diag[k] = infl * (diag[k] - mu[k] * mu[k] / sc[r, _SC1])
                    tr = infl * (tr - mu2 / sc[r, _SC1])
            else:
                for k in range(d):
                    diag[k] = 0.0
            tr = max(tr, 0.0)
            o[F_CERT2] = tr
            if pop == 0:
                o[F_CERT2_SMALL] = 0.0
            elif mr <= 1.0:
                o[F_CERT2_SMALL] = np.inf
            else:
                o[F_CERT2_SMALL] = tr * mr / (mr - 1.0)
            if pop == 0:
                o[F_WALD] = np.nan
                o[F_WALD_T] = np.nan
            else:
                cov = 0.0
                cov_t = 0.0
                mi = int(mr)
                factor = t_table[mi] * np.sqrt(mr / (mr - 1.0)) if mi > 1 else np.inf
                for k in range(d):
                    dk = max(diag[k], 0.0)
                    ae = abs(est[hh, k] - truth[h, q, k])
                    if ae <= z_wald * np.sqrt(dk):
                        cov += 1.0
                    if mi <= 1 or ae <= factor * np.sqrt(dk):
                        cov_t += 1.0
                o[F_WALD] = cov / d
                o[F_WALD_T] = cov_t / d
            o[F_TRV2] = np.nan
            if want_trv2:
                # mu holds sum (1-pi) a r; Rosén's centre divides it by sum (1-pi).
                o[F_TRV2] = _trace_sq(We[r], Z[r], cw, Vk, est[hh], mu / sc[r, _SC1]
                                      if fixed_var else mu, kept_idx, mt, t, fixed_var,
                                      mr) if (tail and mr > 0) else 0.0
        if certify and use_os:
            lcert[q] += _group_variance(a, G, npx, est, Z, sc, T, Tx, sx, gam, pidx) \
                if tail else 0.0


@nb.njit(cache=True)
def _trace_sq(w, z, cw, Vk, est, mu, kept_idx, mt, t, fixed_var, mr):
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


@nb.njit(cache=True)
def _group_variance(a, G, npx, est, Z, sc, T, Tx, sx, gam, pidx):
    """``sum_{i in S} (1-pi_i) |sum_h a_hi W_h (v_i - o_h)|^2`` for query ``a`` of the block."""
    d = est.shape[1]
    total = 0.0
    for ha in range(G):
        for hb in range(ha, G):
            pq = pidx[ha, hb]
            ra = a * G + ha
            rb = a * G + hb
            if ha == hb:
                s_ab = sc[ra, _SC]
                q_ab = sc[ra, _QG]
                tv = T[ra]
            else:
                x = pidx[ha, hb] - G  # cross pairs are stored after the G diagonal pairs
                s_ab = sx[a * npx + x, 0]
                q_ab = sx[a * npx + x, 1]
                tv = Tx[a * npx + x]
            term = q_ab
            quad = 0.0
            for k in range(d):
                b1 = 0.0  # (Gamma o_b)_k
                b2 = 0.0  # (Gamma^T o_a)_k
                for l in range(d):
                    b1 += gam[pq, k, l] * est[hb, l]
                    b2 += gam[pq, l, k] * est[ha, l]
                term -= tv[k] * (b1 + b2)
                quad += est[ha, k] * b1
            term += s_ab * quad
            total += (1.0 if ha == hb else 2.0) * term / (Z[ra] * Z[rb])
    return total


@nb.njit(cache=True, parallel=True)
def replay_kernel(E, zfull, V, V2, vn2, truth, qpos, pi, tau, ev_qptr, ev_q, slot_ev, kmask,
                  u, it_cfg, it_seed, it_slot, it_kslot, flags, z_wald, t_table, gam, vq, pidx,
                  wo_t, want_trv2, out, lout):
    """Replay every iteration (policy, seed) over one layer; see the module docstring.

    Shapes: ``E`` (H, NQ, P); ``zfull`` (H, NQ); ``V``, ``V2`` (n_kv, P, d); ``vn2`` (n_kv, P);
    ``truth`` (H, NQ, d); ``qpos`` (NQ,); ``pi`` (n_events, n_kv, P); ``kmask`` (>=1, n_kv, P);
    ``u`` (S, n_kv, P); ``flags`` (n_cfg, 3) = (corrected, certify, fixed variance);
    ``t_table`` (P + 2,) Student quantiles by tail size; ``gam`` (n_kv, n_pairs, d, d) and
    ``vq`` (n_kv, n_pairs, P) for the output space (``wo_t`` (H*d, hidden), empty rows = off);
    ``pidx`` (G, G) pair index (diagonal pairs 0..G-1, then cross pairs);
    ``out`` (n_iter, H, NQ, N_FIELDS); ``lout`` (n_iter, NQ, N_LAYER_FIELDS).
    """
    H, NQ, P = E.shape
    n_kv = V.shape[0]
    d = V.shape[2]
    G = H // n_kv
    use_os = wo_t.shape[0] > 0
    for it in nb.prange(it_cfg.size):
        c = it_cfg[it]
        corrected = flags[c, 0] == 1
        certify = flags[c, 1] == 1
        fixed_var = flags[c, 2] == 1
        s = it_seed[it]
        slot = it_slot[it]
        ks = it_kslot[it]
        err = np.zeros((NQ, H * d))
        lcert = np.zeros(NQ)
        keptflag = np.empty(P, dtype=np.bool_)
        kept_idx = np.empty(P, dtype=np.int64)
        for g in range(n_kv):
            for e in range(slot_ev[slot], slot_ev[slot + 1]):
                qrows = ev_q[ev_qptr[e]:ev_qptr[e + 1]]
                if qrows.size == 0:
                    continue
                mt, m, kb, ex = gather_kept(pi[e, g], u[s, g], kmask[max(ks, 0), g], ks >= 0,
                                            tau[e], keptflag, kept_idx)
                _unit(E, zfull, V[g], V2[g], vn2[g], truth, qpos, qrows, g, G, pi[e, g],
                      keptflag, kept_idx, mt, m, kb, ex, e - slot_ev[slot], corrected,
                      certify, fixed_var, z_wald, t_table, gam[g], vq[g], pidx, use_os,
                      want_trv2, out[it], err, lcert)
        if use_os:
            Y = np.dot(err, wo_t)
            for q in range(NQ):
                acc = 0.0
                for k in range(Y.shape[1]):
                    acc += Y[q, k] * Y[q, k]
                lout[it, q, L_ERR2] = acc
                lout[it, q, L_CERT2] = lcert[q] if certify else np.nan
        else:
            for q in range(NQ):
                lout[it, q, L_ERR2] = np.nan
                lout[it, q, L_CERT2] = np.nan
