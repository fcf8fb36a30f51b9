"""One unit of the replay kernel: a (policy, seed) iteration's (KV head, event) pair.

:func:`replay_unit` gathers nothing itself (the kept set comes from
:func:`tracesim.kernels.replay_events.event_kept`); it builds the weight rows of the group's
heads and the event's queries, multiplies them with the kept values and finishes each row:
estimate, error, certificates, coverage and the oracle diagnostics, plus the output-space
terms. The steps are described in :mod:`tracesim.kernels.replay`, which drives the units over
the iterations; the field numbers of the outputs are defined here and re-exported there.
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
    largest_sampled_out,
)
from tracesim.kernels.replay_fused import FUSED_ROWS, fused_products, weight_rows
from tracesim.kernels.replay_output_space import group_variance
from tracesim.kernels.replay_rows import cross_sums, row_sums, tail_sums, trace_sq

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
def replay_unit(layer, ev, osp, cert, unit, res):
    """Replay one (iteration, KV head, event) unit: estimate, error and certificates of each
    (query, head) row of the event's queries and the group's heads.

    Parameters
    ----------
    layer : ChunkTensors
        The layer's tensors.
    ev : EventParts
        Seed-independent per-event results (oracle statistics, take-all parts).
    osp : OutputSpace
        Output-space operands (empty ``rpack``: the output space is off).
    cert : CertificateConstants
        Quantiles of the coverage events and whether to compute ``tr(V_hat^2)``.
    unit : KeptUnit
        The unit's kept set (from :func:`tracesim.kernels.replay_events.gather_kept`) and its
        policy's rules.
    res : IterationOutputs
        The iteration's outputs: this unit writes ``res.out[h, q]`` and ``res.errT[h*d:, q]``
        for its rows and adds its queries' output-space certificate terms to ``res.lcert``.
    """
    # Fields unpacked to the names of the formulas (no copies: array views and scalars).
    E, zfull, truth, qpos = layer.E, layer.zfull, layer.truth, layer.qpos
    qrows, j0, g = unit.qrows, unit.j0, unit.g
    pi_row, keptflag, kept_idx = unit.pi_row, unit.keptflag, unit.kept_idx
    mt, m, kb, ex, event = unit.mt, unit.m, unit.kb, unit.ex, unit.event
    corrected, certify, fixed_var = unit.corrected, unit.certify, unit.fixed_var
    z_wald, t_table, want_trv2 = cert.z_wald, cert.t_table, cert.want_trv2
    stats, top, xta, zta, nta = ev.stats, ev.top, ev.xta, ev.zta, unit.n_take_all
    pidx = osp.pidx
    use_os = osp.rpack.size > 0
    out_it, errT, lcert = res.out, res.errT, res.lcert
    Vg = layer.V[g]
    vn2g = layer.vn2[g]
    gblk = osp.gblk[g]
    vqg = osp.vq[g]
    G = E.shape[0] // layer.V.shape[0]
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
    mest = mt if shared else m
    # Few rows (a per-step event: one query): the value products in one pass over the kept
    # rows in place (tracesim.kernels.replay_fused), else gather them once for BLAS.
    fused = R <= FUSED_ROWS and not want_trv2
    if fused:
        We, Z = weight_rows(E, qrows, g, G, kept_idx, mest, inv, Vg)
        Vk = np.empty((0, d), Vg.dtype)
        X = np.empty((0, d), Vg.dtype)  # from fused_products below
    else:
        We, Vk, X, Z = estimate_block(E, Vg, qrows, g, G, kept_idx, mest, inv)
    if shared:
        for a in range(nqe):
            for hh in range(G):
                Z[a * G + hh] += zta[j0 + a, g * G + hh]
    # The learned sink: a take-all term of value 0, in every normaliser (adds 0.0 without).
    zsink, window = layer.zsink, layer.window
    for a in range(nqe):
        for hh in range(G):
            Z[a * G + hh] += zsink[g * G + hh, qrows[a]]
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
        # A sliding layer's tail tokens before the window have E = 0: in no sum, not counted.
        n_before = np.searchsorted(kept_idx[:mt], t - window, side="right") if window > 0 else 0
        for hh in range(G):
            r = a * G + hh
            sc[r, _Z] = Z[r]
            w = We[r]
            km, sw, sw2 = row_sums(w, piv, nv)
            wmax = 0.0
            for j in range(nv):
                wmax = max(wmax, np.float64(w[j]))
            s_c = 0.0
            s_q = 0.0
            s_qg = 0.0
            s_cw = 0.0
            s_c1 = 0.0
            if tail:
                s_c, s_q, s_qg = tail_sums(w, cw, vnk, vqk[pidx[hh, hh]], nv, use_os, Wd[r])
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
            n_t = float(nv - n_before)
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
                    s0, s1 = cross_sums(We[ra], We[rb], cw, vqk[pq], mt, Wxf[rx])
                    sx[rx, 0] = s0
                    sx[rx, 1] = s1
                    x += 1
    if fused:
        X, TD, XF = fused_products(Vg, kept_idx, mest, mt, We, Wd, Wxf)
    elif tail:
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
                o[F_TRV2] = trace_sq(We[r], Z[r], cw, Vk, est[hh], mu / sc[r, _SC1]
                                      if fixed_var else mu, kept_idx, mt, t, fixed_var,
                                      mr) if (tail and mr > 0) else 0.0
    if certify and use_os and tail:
        group_variance(qrows, G, npx, est3, Z, sc[:, _SC], sc[:, _QG], TD, XF, sx, gblk,
                       lcert)
