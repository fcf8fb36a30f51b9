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
3. multiplies them with the kept values (BLAS dgemm, one thread per iteration; units of at
   most ``FUSED_ROWS`` rows in one pass over the kept rows in place,
   :mod:`tracesim.kernels.replay_fused`, four tokens at a time when every kept token is a
   tail token, :mod:`tracesim.kernels.fused_tiles`), and
4. finishes each row: estimate, error, certificates, coverage, oracle diagnostics.

Certificates use the running sums ``S2 - 2 o.S1 + |o|^2 S0`` (see ``tracesim.estimators``),
whose per-row reductions are in :mod:`tracesim.kernels.replay_rows`; the output-space
certificate and the layer error are in :mod:`tracesim.kernels.replay_output_space`. The
operands come in named tuples documented in :mod:`tracesim.kernels.replay_operands`.

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
    event_kept,
    largest_sampled_out,
)
from tracesim.kernels.replay_fused import FUSED_ROWS, fused_products, weight_rows
from tracesim.kernels.replay_operands import IterationOutputs, KeptUnit
from tracesim.kernels.replay_output_space import (
    error_block,
    error_packs,
    group_variance,
    pack_columns,
    pack_layer_error,
)
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
def _unit(layer, ev, osp, cert, unit, res):
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


@nb.njit(cache=True, parallel=True)
def replay_kernel(layer, incl, its, cert, ev, osp, res):
    """Replay every iteration (policy, seed) over one chunk of a layer's queries; see the
    module docstring.

    Parameters
    ----------
    layer : ChunkTensors
        Exp-logits, normalisers, values, ``|v|^2``, truth and query positions.
    incl : InclusionArrays
        Inclusion probabilities, event times, event -> query lists, slots, fixed-size kept
        masks and per-step streams.
    its : IterationTables
        The (policy, seed) iterations, the policies' flags, the permanent uniforms, the seeds
        and the layer index (fresh per-step uniforms are drawn here, per unit).
    cert : CertificateConstants
        Wald and Student quantiles, ``tr(V_hat^2)`` on or off.
    ev : EventParts
        From :func:`tracesim.kernels.replay_events.event_parts`.
    osp : OutputSpace
        Gram blocks, quadratic forms and the layer error's packed triangular factor
        (:func:`tracesim.kernels.replay_output_space.layer_error`; empty
        ``rpack`` = off).
    res : ReplayOutputs
        Written: ``out[it]`` and ``lout[it]`` of every iteration.
    """
    E, V, rpack = layer.E, layer.V, osp.rpack
    pi, ev_qptr, ev_q, slot_ev = incl.pi, incl.ev_qptr, incl.ev_q, incl.slot_ev
    it_cfg, it_seed, it_slot, it_kslot = its.it_cfg, its.it_seed, its.it_slot, its.it_kslot
    flags, u, seed_values, layer_index = its.flags, its.u, its.seed_values, its.layer
    lout = res.lout
    H, NQ, P = E.shape
    n_kv = V.shape[0]
    d = V.shape[2]
    use_os = rpack.size > 0
    Hd = H * d
    n_it = it_cfg.size
    # The layer error's GEMMs take the errors of several iterations at once: each block of
    # iterations writes its errors, then the block's packs (``error_packs``) are multiplied.
    # Blocks and packs depend on the sizes only, never on the threads.
    per_block = error_block(n_it, Hd * NQ * rpack.itemsize) if use_os else max(n_it, 1)
    for b0 in range(0, n_it, per_block):
        b1 = min(n_it, b0 + per_block)
        pstart = error_packs(b1 - b0, NQ)
        errflat = np.zeros(((b1 - b0) * Hd * NQ) if use_os else 0, rpack.dtype)
        for i in nb.prange(b1 - b0):
            it = b0 + i
            c = it_cfg[it]
            corrected = flags[c, 0] == 1
            certify = flags[c, 1] == 1
            fixed_var = flags[c, 2] == 1
            s = it_seed[it]
            slot = it_slot[it]
            ks = it_kslot[it]
            if use_os:
                errT = pack_columns(errflat, pstart, i, Hd, NQ)
            else:
                errT = np.zeros(Hd * NQ, rpack.dtype).reshape((Hd, NQ))[:, 0:NQ]
            lcert = np.zeros(NQ)
            keptflag = np.empty(P, dtype=np.bool_)
            kept_idx = np.empty(P, dtype=np.int64)
            ufresh = np.empty(P)
            written = IterationOutputs(res.out[it], errT, lcert)
            for g in range(n_kv):
                for e in range(slot_ev[slot], slot_ev[slot + 1]):
                    qrows = ev_q[ev_qptr[e]:ev_qptr[e + 1]]
                    if qrows.size == 0:
                        continue
                    mt, m, kb, ex = event_kept(incl, e, g, s, ks, u, seed_values, layer_index,
                                               keptflag, kept_idx, ufresh)
                    unit = KeptUnit(qrows, ev_qptr[e], g, pi[e, g], keptflag, kept_idx, mt, m,
                                    kb, ex, e - slot_ev[slot], ev.nta[e, g], corrected,
                                    certify, fixed_var)
                    _unit(layer, ev, osp, cert, unit, written)
            for q in range(NQ):
                lout[it, q, L_ERR2] = np.nan
                lout[it, q, L_CERT2] = lcert[q] if (certify and use_os) else np.nan
        if use_os:
            for pk in nb.prange(pstart.size - 1):
                pack_layer_error(errflat, pstart, pk, osp, lout[b0:b1, :, L_ERR2])
