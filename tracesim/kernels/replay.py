"""Compiled replay kernel: every (policy, seed) against one layer's shared logits.

The engine computes ``E[h, q, p] = exp(s_hqp - max_p s_hqp)`` (causal zeros) once per layer, so
a policy's Hájek weight of a kept token is just ``E / pi``: no logits and no exponentials are
recomputed per policy or seed. For one (iteration, KV head, event) *unit* the kernel

1. gathers the kept tokens (tail ``pi < 1`` first, then take-all, each in position order),
2. builds the weight matrices of the group's heads and the event's queries (rows) over the
   kept *tail* tokens (columns): ``w``, ``(1-pi) w^2`` and, for the output-space certificate,
   ``(1-pi) w_a w_b`` across the group's head pairs; the take-all part of the estimate
   (``sum_{pi >= 1} E v`` and ``sum E``) is the event's, computed once for all seeds by
   :func:`tracesim.kernels.replay_events.take_all_kernel` (only a fixed-size mask that drops
   a take-all token falls back to the whole kept set),
3. multiplies them with the kept values (BLAS dgemm, one thread per iteration), and
4. finishes each row: estimate, error, certificates, coverage, oracle diagnostics.

Certificates use the running sums ``S2 - 2 o.S1 + |o|^2 S0`` (see ``tracesim.estimators``);
the output-space certificate expands ``|sum_h a_h W_h (v - o_h)|^2`` with the Gram blocks
``W_a^T W_b`` so no per-token vector of the hidden size is ever formed, and the layer error
``|W_O (o_hat - o)|^2`` is ``|R (o_hat - o)|^2`` with ``R`` the triangular factor of ``W_O``.

Each iteration writes only its own output slots and calls BLAS single-threaded (the caller
sets the BLAS thread limit), so results are bit-identical for any number of numba threads and
any order of iterations.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from tracesim.kernels.replay_events import (
    S_ELIG_MASS,
    S_EV_MASS,
    S_EV_MAX,
    S_N_ELIG,
    S_POP,
    estimate_block,
    gather_kept,
    largest_sampled_out,
)
from tracesim.prn import step_uniforms_into

# Fields of ``out[iteration, head, query, :]``.
F_ERR2, F_REL, F_CERT2, F_CERT2_SMALL, F_TAIL, F_NEFF, F_WALD, F_WALD_T, F_TRV2 = range(9)
F_KEPT, F_EXPECTED, F_POP, F_OUT_MASS, F_OUT_MAX, F_EV_MASS, F_EV_MAX, F_EVENT = range(9, 17)
F_MAX_TAIL = 17  # largest normalised Hájek weight of a kept tail token (NaN: none / uncertified)
N_FIELDS = 18
# Fields of ``lout[iteration, query, :]`` (per layer, output space).
L_ERR2, L_CERT2 = 0, 1
N_LAYER_FIELDS = 2
# Row scalars.
_Z, _SC, _Q, _SW, _SW2, _SCW, _SC1, _MT, _QG, _WMAX = range(10)
_NS = 10


@nb.njit(cache=True)
def _unit(E, zfull, Vg, vn2g, truth, qpos, qrows, j0, g, G, pi_row, keptflag, kept_idx,
          mt, m, kb, ex, event, corrected, certify, fixed_var, z_wald, t_table, gblk,
          vqg, pidx, use_os, want_trv2, stats, top, xta, zta, nta, out_it, errT, lcert):
    nqe = qrows.size
    d = Vg.shape[1]
    R = nqe * G
    inv = np.empty(m)
    piv = np.empty(m)  # 1 / inv: turns a weight back into exp(s) without re-reading E
    cw = np.empty(m)
    for j in range(m):
        pv = pi_row[kept_idx[j]]
        inv[j] = 1.0 / pv if corrected else 1.0
        piv[j] = pv if corrected else 1.0
        cw[j] = 1.0 - pv if pv < 1.0 else 0.0
    # When every take-all token is kept (always, except for a fixed-size mask that drops one)
    # the take-all part of X and Z is the event's, shared by all seeds: only the sampled tail
    # is this seed's own work. Take-all columns of We and Vk are not needed beyond X and Z.
    shared = m - mt == nta
    We, Vk, X, Z = estimate_block(E, Vg, qrows, g, G, kept_idx, mt if shared else m, inv)
    if shared:
        for a in range(nqe):
            for hh in range(G):
                Z[a * G + hh] += zta[j0 + a, g * G + hh]
    sc = np.zeros((R, _NS))
    kmass = np.zeros(R)
    tail = certify and mt > 0
    npx = G * (G - 1) // 2 if use_os else 0
    nf = R if (tail and fixed_var) else 0
    Wd = np.empty((R if tail else 0, mt), Vg.dtype)
    # Cross-pair rows (output space) then fixed-size centring rows share one GEMM with V.
    Wxf = np.empty(((nqe * npx if tail else 0) + nf, mt), Vg.dtype)
    sx = np.zeros((nqe * npx, 2))
    # Per-token constants of the kept tail, gathered once per unit (contiguous for the sums).
    vnk = np.empty(mt if tail else 0)
    vqk = np.empty((vqg.shape[0], mt if (tail and use_os) else 0))
    if tail:
        for j in range(mt):
            vnk[j] = vn2g[kept_idx[j]]
        if use_os:
            for i in range(vqg.shape[0]):
                for j in range(mt):
                    vqk[i, j] = vqg[i, kept_idx[j]]
    for a in range(nqe):
        q = qrows[a]
        t = qpos[q]
        # Tail tokens are in position order: the query sees the first nv of them.
        nv = np.searchsorted(kept_idx[:mt], t, side="right")
        for hh in range(G):
            r = a * G + hh
            sc[r, _Z] = Z[r]
            w = We[r]
            km, sw, sw2 = _row_sums(w, piv, nv)
            wmax = 0.0
            for j in range(nv):
                wmax = max(wmax, np.float64(w[j]))
            s_c = 0.0
            s_q = 0.0
            s_qg = 0.0
            s_cw = 0.0
            s_c1 = 0.0
            if tail:
                s_c, s_q, s_qg = _tail_sums(w, cw, vnk, vqk[pidx[hh, hh]], nv, use_os, Wd[r])
                for j in range(nv, mt):
                    Wd[r, j] = 0.0
                if fixed_var:
                    fr = nqe * npx + r
                    for j in range(nv):
                        cwj = cw[j] * w[j]
                        Wxf[fr, j] = cwj
                        s_cw += cwj
                        s_c1 += cw[j]
                    for j in range(nv, mt):
                        Wxf[fr, j] = 0.0
            n_t = float(nv)
            kmass[r] = km
            sc[r, _MT] = n_t
            sc[r, _SW] = sw
            sc[r, _SW2] = sw2
            sc[r, _SC] = s_c
            sc[r, _Q] = s_q
            sc[r, _QG] = s_qg
            sc[r, _SCW] = s_cw
            sc[r, _SC1] = s_c1
            sc[r, _WMAX] = wmax
        if tail and use_os:
            x = 0
            for ha in range(G):
                for hb in range(ha + 1, G):
                    rx = a * npx + x
                    ra = a * G + ha
                    rb = a * G + hb
                    pq = pidx[ha, hb]
                    s0, s1 = _cross_sums(We[ra], We[rb], cw, vqk[pq], mt, Wxf[rx])
                    sx[rx, 0] = s0
                    sx[rx, 1] = s1
                    x += 1
    if tail:
        # One GEMM gives both sum (1-pi) w^2 v and sum (1-pi) w^2 v^2 (Wald diagonal).
        VV = np.empty((mt, 2 * d), Vg.dtype)
        for j in range(mt):
            for k in range(d):
                vk = Vk[j, k]
                VV[j, k] = vk
                VV[j, d + k] = vk * vk
        TD = np.dot(Wd, VV)
        XF = np.dot(Wxf, Vk[:mt]) if Wxf.shape[0] > 0 else np.zeros((0, d), Vg.dtype)
    else:
        TD = np.zeros((0, 2 * d), Vg.dtype)
        XF = np.zeros((0, d), Vg.dtype)
    est3 = np.empty((G, nqe, d))
    diag = np.empty(d)
    mu = np.zeros(d)
    for a in range(nqe):
        q = qrows[a]
        t = qpos[q]
        for hh in range(G):
            h = g * G + hh
            r = a * G + hh
            o = out_it[h, q]
            st = stats[j0 + a, h]
            est = est3[:, a]
            e2 = 0.0
            n2 = 0.0
            for k in range(d):
                xs = xta[j0 + a, h, k] if shared else 0.0
                est[hh, k] = (X[r, k] + xs) / Z[r]
                dk = est[hh, k] - truth[h, q, k]
                errT[h * d + k, q] = dk
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
            pop = st[S_POP]
            zf = zfull[h, q]
            o[F_POP] = pop
            o[F_OUT_MASS] = max(0.0, st[S_ELIG_MASS] - kmass[r] / zf)
            o[F_OUT_MAX] = largest_sampled_out(E, h, q, t, zf, pi_row, keptflag,
                                               top[j0 + a, h], int(st[S_N_ELIG]))
            o[F_EV_MASS] = st[S_EV_MASS]
            o[F_EV_MAX] = st[S_EV_MAX]
            o[F_MAX_TAIL] = sc[r, _WMAX] / Z[r] if (certify and mr > 0) else np.nan
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
                    tk = TD[r, k]
                    on += est[hh, k] * est[hh, k]
                    tr -= 2.0 * est[hh, k] * tk
                    diag[k] = (TD[r, d + k] - 2.0 * est[hh, k] * tk
                               + est[hh, k] * est[hh, k] * s0) / zz
                tr = (sc[r, _Q] + tr + on * s0) / zz
                if fixed_var:
                    # Rosén: centre a_i r_i on its (1-pi)-weighted mean, inflate by m/(m-1).
                    infl = mr / (mr - 1.0) if mr > 1.0 else 0.0
                    mu2 = 0.0
                    for k in range(d):
                        mu[k] = (XF[nqe * npx + r, k] - est[hh, k] * sc[r, _SCW]) / Z[r]
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
    if certify and use_os and tail:
        _group_variance(qrows, G, npx, est3, Z, sc, TD, XF, sx, gblk, lcert)


@nb.njit(cache=True, fastmath={"reassoc", "contract"})
def _row_sums(w, piv, n):
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
def _tail_sums(w, cw, vnk, vqd, n, use_os, wd):
    """Row ``wd = (1-pi) w^2`` of the certificate's GEMM and its sums ``sum wd``,
    ``sum wd |v|^2`` and (output space) ``sum wd v^T Gamma_aa v``."""
    s_c = 0.0
    s_q = 0.0
    s_qg = 0.0
    # Two loops rather than a test inside one: without the output space ``vqd`` is empty, and
    # the loop that runs by default stays a plain two-accumulator reduction.
    if use_os:
        for j in range(n):
            x = np.float64(w[j])
            v = cw[j] * x * x
            wd[j] = v
            s_c += v
            s_q += v * vnk[j]
            s_qg += v * vqd[j]
    else:
        for j in range(n):
            x = np.float64(w[j])
            v = cw[j] * x * x
            wd[j] = v
            s_c += v
            s_q += v * vnk[j]
    return s_c, s_q, s_qg


@nb.njit(cache=True, fastmath={"reassoc", "contract"})
def _cross_sums(wa, wb, cw, vq, n, wx):
    """Row ``wx = (1-pi) w_a w_b`` of a head pair and its sums ``sum wx``,
    ``sum wx v^T Gamma_ab v``."""
    s0 = 0.0
    s1 = 0.0
    for j in range(n):
        v = cw[j] * np.float64(wa[j]) * np.float64(wb[j])
        wx[j] = v
        s0 += v
        s1 += v * vq[j]
    return s0, s1


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
def _group_variance(qrows, G, npx, est3, Z, sc, TD, XF, sx, gblk, lcert):
    """Add ``sum_{i in S} (1-pi_i) |sum_h a_hi W_h (v_i - o_h)|^2`` of each block query to
    ``lcert``. The Gram products ``Gamma_ab o_b`` of every ordered head pair come from one GEMM
    per head b, ``o_b^T [Gamma_b0 ... Gamma_b,G-1]`` (``gblk[b]``: row block b of the group's
    ``W_g^T W_g``)."""
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
                    s_ab = sc[ra, _SC]
                    term = sc[ra, _QG]
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
def _layer_error(errT, rpack, roff, rstart, lerr):
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


@nb.njit(cache=True, parallel=True)
def replay_kernel(E, zfull, V, vn2, truth, qpos, pi, tau, ev_qptr, ev_q, slot_ev, kmask,
                  u, ev_stream, seed_values, layer, it_cfg, it_seed, it_slot, it_kslot, flags,
                  z_wald, t_table, gblk, vq, pidx, rpack, roff, rstart, want_trv2, stats, top,
                  xta, zta, nta, out, lout):
    """Replay every iteration (policy, seed) over one layer; see the module docstring.

    Shapes: ``E`` (H, NQ, P); ``zfull`` (H, NQ); ``V`` (n_kv, P, d); ``vn2`` (n_kv, P) = ``|v|^2``;
    ``truth`` (H, NQ, d); ``qpos`` (NQ,); ``pi`` (n_events, n_kv, P); ``kmask`` (>=1, n_kv, P);
    ``u`` (S, n_kv, P) permanent uniforms (stream 0); ``ev_stream`` (n_events,): -1 where the
    event's kept set is decided by ``u``, else the stream of its fresh per-step uniforms, drawn
    here from ``seed_values`` (S,) and ``layer`` (:func:`tracesim.prn.step_uniforms_into`);
    ``flags`` (n_cfg, 3) = (corrected, certify, fixed variance);
    ``t_table`` (P + 2,) Student quantiles by tail size; for the output space ``gblk``
    (n_kv, G, d, G*d): row blocks of each group's ``W_g^T W_g``, ``vq`` (n_kv, n_pairs, P),
    and the layer error's packed triangular factor ``rpack``/``roff``/``rstart``
    (:func:`_layer_error`; empty ``rpack`` = off);
    ``pidx`` (G, G) pair index (diagonal pairs 0..G-1, then cross pairs); ``stats`` and
    ``top`` from :func:`tracesim.kernels.replay_events.event_stats_kernel`; ``xta``, ``zta``
    and ``nta`` from :func:`tracesim.kernels.replay_events.take_all_kernel`;
    ``out`` (n_iter, H, NQ, N_FIELDS); ``lout`` (n_iter, NQ, N_LAYER_FIELDS).
    """
    H, NQ, P = E.shape
    n_kv = V.shape[0]
    d = V.shape[2]
    G = H // n_kv
    use_os = rpack.size > 0
    for it in nb.prange(it_cfg.size):
        c = it_cfg[it]
        corrected = flags[c, 0] == 1
        certify = flags[c, 1] == 1
        fixed_var = flags[c, 2] == 1
        s = it_seed[it]
        slot = it_slot[it]
        ks = it_kslot[it]
        errT = np.zeros((H * d, NQ), rpack.dtype)
        lcert = np.zeros(NQ)
        keptflag = np.empty(P, dtype=np.bool_)
        kept_idx = np.empty(P, dtype=np.int64)
        ufresh = np.empty(P)
        for g in range(n_kv):
            for e in range(slot_ev[slot], slot_ev[slot + 1]):
                qrows = ev_q[ev_qptr[e]:ev_qptr[e + 1]]
                if qrows.size == 0:
                    continue
                urow = u[s, g]
                if ev_stream[e] >= 0:
                    step_uniforms_into(seed_values[s], ev_stream[e], layer, g, tau[e], ufresh)
                    urow = ufresh
                mt, m, kb, ex = gather_kept(pi[e, g], urow, kmask[max(ks, 0), g], ks >= 0,
                                            tau[e], keptflag, kept_idx)
                _unit(E, zfull, V[g], vn2[g], truth, qpos, qrows, ev_qptr[e], g, G,
                      pi[e, g], keptflag, kept_idx, mt, m, kb, ex, e - slot_ev[slot],
                      corrected, certify, fixed_var, z_wald, t_table, gblk[g], vq[g],
                      pidx, use_os, want_trv2, stats, top, xta, zta, nta[e, g], out[it], errT,
                      lcert)
        if use_os:
            lerr = np.empty(NQ)
            _layer_error(errT, rpack, roff, rstart, lerr)
            for q in range(NQ):
                lout[it, q, L_ERR2] = lerr[q]
                lout[it, q, L_CERT2] = lcert[q] if certify else np.nan
        else:
            for q in range(NQ):
                lout[it, q, L_ERR2] = np.nan
                lout[it, q, L_CERT2] = np.nan
