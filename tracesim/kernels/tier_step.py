"""One decode step of the tiers simulator: every KV head, scheduler and budget, in a fixed order.

The layer drivers and the entry point are in :mod:`tracesim.kernels.tiers` (which documents the
two passes and the budget order); the per-head passes are in :mod:`tracesim.kernels.tier_passes`.
Everything inside a step runs in a fixed order, so the results do not depend on the number of
threads that run the steps.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from tracesim.kernels.tier_passes import _add_page, _logits, _n_le, _value_pass
from tracesim.kernels.tier_priorities import N_BUILTIN, PageInputs, builtin_priority


@nb.njit(cache=True)
def tiers_step(a, att, inc, pages, schedule, out, plugin):
    """Simulate decode step ``a`` of one layer, every scheduler and budget of ``schedule``.

    ``att``, ``inc``, ``pages``, ``schedule`` and ``out`` are an :class:`Attention`,
    :class:`Inclusion`, :class:`Pages`, :class:`SchedulerTable` and :class:`TierOutputs`;
    ``plugin`` is the callback of the run's registered rules
    (:func:`tracesim.kernels.tier_priorities.plugin_priority`).
    """
    K, V, Q, qpos, scale, softcap, window, sinks = att
    pi, kept, hajek, certified, tail_off, tail_pos = inc
    (pg_off, pg_first, pg_count, pg_kmin, pg_kmax, pg_vcen, pg_vrad, pg_bytes, pg_tier,
     block_slot, page) = pages
    codes, fetches, scaled, budgets, conf_w, rprio, need_bound, need_uniforms = schedule
    (err_before, cert, err_after, kv_bytes, kv_pages, evicted, tier_nf, tier_nb, kept_tok,
     order_out, nsel_out) = out
    n_kv, _, d = K.shape
    H = Q.shape[0]
    G = H // n_kv
    NP = pg_off[n_kv]
    NS, NB = codes.size, budgets.size
    t = qpos[a]
    n = t + 1
    # a sliding layer holds (t - w, t]; its pages behind the window (every position < lo) are
    # freed, a page straddling the window start stays whole
    lo = max(0, t - window + 1) if window > 0 else 0
    first_held = lo // page * page
    e = np.empty((n_kv, n, G))
    etot = np.zeros((n_kv, G))
    o = np.zeros((n_kv, G, d))             # full-cache numerators, then outputs
    bnum = np.zeros((n_kv, G, d))
    bden = np.zeros((n_kv, G))
    c2 = np.zeros(n_kv)                    # certificate summed over the group's heads
    pd = np.zeros((NP, G))                 # attention mass of each evicted page
    pc = np.zeros(NP)                      # the page's share of the certificate
    bterm = np.zeros(NP)
    orc = np.zeros(NP)
    nvis = np.zeros(n_kv, np.int64)
    nfree = np.zeros(n_kv, np.int64)       # pages wholly behind the window, per head
    zs = np.zeros(G)                       # the sink's denominator term per head of the group
    head_of = np.empty(NP, np.int64)
    qv = np.empty((G, d))
    smax = np.empty(G)
    rnum = np.empty((G, d))
    er = np.empty(G)
    acc = np.empty((4, G, d))
    accd = np.empty((4, G))
    ohat = np.empty((G, d))
    c2h = np.empty(G)
    ktok = 0
    for g in range(n_kv):
        p0, p1 = pg_off[g], pg_off[g + 1]
        for p in range(p0, p1):
            head_of[p] = g
        nv = 0
        while p0 + nv < p1 and pg_first[p0 + nv] <= t:
            nv += 1
        nvis[g] = nv
        nf = 0
        while nf < nv and pg_first[p0 + nf] < first_held:
            nf += 1
        nfree[g] = nf
        for h in range(G):
            for k in range(d):
                qv[h, k] = Q[g * G + h, a, k]
        e_g = e[g]
        _logits(K[g], qv, lo, n, scale, softcap, e_g, smax)
        for h in range(G):
            zs[h] = 0.0
            if sinks[g * G + h] > -np.inf:
                smax[h] = max(smax[h], sinks[g * G + h])
                zs[h] = np.exp(sinks[g * G + h] - smax[h])
        for i in range(lo, n):
            for h in range(G):
                e_g[i, h] = np.exp(e_g[i, h] - smax[h])
        Vg = V[g]
        acc[:] = 0.0
        accd[:] = 0.0
        ktok += _value_pass(e_g, Vg, lo, n, kept[g], pi[g], hajek, page, block_slot[g], p0,
                            acc, accd, pd)
        wb = 3 if hajek else 1                # the sampled tokens' class in the estimate
        for h in range(G):
            # the sink is a take-all term with value zero: every denominator, no numerator
            etot[g, h] = accd[0, h] + accd[1, h] + accd[2, h] + zs[h]
            er[h] = accd[0, h] + accd[1, h] + zs[h]
            bden[g, h] = accd[0, h] + accd[wb, h] + zs[h]
            for k in range(d):
                o[g, h, k] = acc[0, h, k] + acc[1, h, k] + acc[2, h, k]
                rnum[h, k] = acc[0, h, k] + acc[1, h, k]
                bnum[g, h, k] = acc[0, h, k] + acc[wb, h, k]
        for h in range(G):
            err = 0.0
            for k in range(d):
                o[g, h, k] /= etot[g, h]
                ohat[h, k] = bnum[g, h, k] / bden[g, h]
                x = ohat[h, k] - o[g, h, k]
                err += x * x
            err_before[g * G + h, a] = err
            c2h[h] = 0.0
        # Sampled kept tokens: the Hájek adjustment of fetched pages, and the certificate.
        for j in range(tail_off[g], tail_off[g + 1]):
            i = tail_pos[j]
            if i > t:
                break
            if i < lo:
                continue
            pv = pi[g, i]
            inv = 1.0 / pv if hajek else 1.0
            b = block_slot[g, i // page]
            if hajek and b >= 0 and b < nv:
                for h in range(G):
                    pd[p0 + b, h] += e_g[i, h] * (1.0 - inv)
            if certified:
                csum = 0.0
                for h in range(G):
                    aw = e_g[i, h] * inv / bden[g, h]
                    dv = 0.0
                    for k in range(d):
                        x = Vg[i, k] - ohat[h, k]
                        dv += x * x
                    c = (1.0 - pv) * aw * aw * dv
                    c2h[h] += c
                    csum += c
                if b >= 0:
                    pc[p0 + b] += csum
        for h in range(G):
            cert[g * G + h, a] = c2h[h]
            c2[g] += c2h[h]
        ev_b = 0.0
        for p in range(p0 + nf, p0 + nv):
            ev_b += pg_bytes[p]
        evicted[g, a] = ev_b
        for p in range(p0, p1):
            m = 0.0
            for h in range(G):
                m += pd[p, h] / etot[g, h]
            orc[p] = m
        if need_bound:
            for h in range(G):
                for k in range(d):
                    rnum[h, k] /= er[h]
            for p in range(p0 + nf, p0 + nv):
                bt = 0.0
                for h in range(G):
                    top = 0.0
                    for k in range(d):
                        top += max(pg_kmin[p, k] * qv[h, k], pg_kmax[p, k] * qv[h, k])
                    u = scale * top
                    if softcap > 0.0:  # the cap is increasing: it caps the bound too
                        u = softcap * np.tanh(u / softcap)
                    u -= smax[h]
                    r2 = 0.0
                    for k in range(d):
                        x = pg_vcen[p, k] - rnum[h, k]
                        r2 += x * x
                    dist = np.sqrt(r2) + pg_vrad[p]
                    bt += pg_count[p] * np.exp(min(u, 700.0)) * dist / er[h]
                bterm[p] = bt
    kept_tok[a] = ktok

    # Candidates: the visible evicted pages, KV head by KV head, in position order.
    cand = np.empty(NP, np.int64)
    nc = 0
    for g in range(n_kv):
        for p in range(pg_off[g] + nfree[g], pg_off[g] + nvis[g]):
            cand[nc] = p
            nc += 1
    total = 0.0
    if window > 0:  # what the sliding layer holds in its lower tiers now
        for c in range(nc):
            total += pg_bytes[cand[c]]
    else:
        for p in range(NP):
            total += pg_bytes[p]
    npages = np.empty(n_kv, np.int64)
    btot = np.zeros(n_kv)
    for g in range(n_kv):
        npages[g] = (nvis[g] - nfree[g]) if window > 0 else pg_off[g + 1] - pg_off[g]
        for p in range(pg_off[g], pg_off[g + 1]):
            btot[g] += bterm[p]
    # Layer totals of the page certificate terms and page bounds (certificate_bound).
    pctot = 0.0
    bsum = 0.0
    for p in range(NP):
        pctot += pc[p]
        bsum += bterm[p]
    prio = np.empty(NP)
    key = np.empty(nc)
    cum = np.empty(nc)
    nsel = np.empty(NB, np.int64)
    border = np.empty(NB, np.int64)
    accn = np.empty((n_kv, G, d))
    accd = np.empty((n_kv, G))
    cnt = np.empty(n_kv, np.int64)
    byt = np.empty(n_kv)
    done = np.empty(n_kv, np.bool_)
    tnf = np.empty(tier_nf.shape[3])
    tnb = np.empty(tier_nf.shape[3])
    for si in range(NS):
        code = codes[si]
        for p in range(NP):
            g = head_of[p]
            u = rprio[a, p] if need_uniforms else 0.0
            if code < N_BUILTIN:
                prio[p] = builtin_priority(code, PageInputs(
                    u, bterm[p], orc[p], pc[p], c2[g], btot[g], npages[g], pctot, bsum))
            else:
                prio[p] = plugin(code - N_BUILTIN, u, bterm[p], orc[p], pc[p], c2[g], btot[g],
                                 npages[g], pctot, bsum)
        n_order = nc if fetches[si] else 0
        if n_order:
            for c in range(nc):
                key[c] = -prio[cand[c]]
            order = cand[np.argsort(key, kind="mergesort")]
        else:
            order = cand[:0]
        run = 0.0
        for c in range(n_order):
            run += pg_bytes[order[c]]
            cum[c] = run
        for bi in range(NB):
            f = budgets[bi]
            if f >= 1.0:
                B = total
            else:
                w = conf_w[a] if scaled[si] else 1.0
                B = min(total, f * total * w)
            nsel[bi] = _n_le(cum, n_order, B * (1 + 1e-12))
            nsel_out[si, bi, a] = nsel[bi]
        if order_out.shape[0] > 0:  # the fetch order itself (the in-loop fetch reads it)
            for c in range(n_order):
                order_out[si, a, c] = order[c]
        # budgets by the pages they fetch (a stable insertion sort: a handful of budgets)
        for bi in range(NB):
            border[bi] = bi
        for bi in range(1, NB):
            x = border[bi]
            j = bi
            while j > 0 and nsel[border[j - 1]] > nsel[x]:
                border[j] = border[j - 1]
                j -= 1
            border[j] = x
        accn[:] = 0.0
        accd[:] = 0.0
        cnt[:] = 0
        byt[:] = 0.0
        tnf[:] = 0.0
        tnb[:] = 0.0
        ptr_meta = 0
        ptr_sum = 0
        for bb in range(NB):
            bi = border[bb]
            ns = nsel[bi]
            while ptr_meta < ns:
                p = order[ptr_meta]
                g = head_of[p]
                cnt[g] += 1
                byt[g] += pg_bytes[p]
                tnf[pg_tier[p]] += 1.0
                tnb[pg_tier[p]] += pg_bytes[p]
                ptr_meta += 1
            for g in range(n_kv):
                done[g] = npages[g] > 0 and cnt[g] == npages[g]
            # A head fetched completely is the full cache: its later pages need no sums.
            while ptr_sum < ns:
                p = order[ptr_sum]
                g = head_of[p]
                if not done[g]:
                    start = pg_first[p] // page * page
                    _add_page(V[g], e[g], kept[g], pi[g], hajek, max(start, lo),
                              min(start + page, n), accn[g], accd[g])
                ptr_sum += 1
            for g in range(n_kv):
                for h in range(G):
                    err = 0.0
                    if not done[g]:
                        den = bden[g, h] + accd[g, h]
                        for k in range(d):
                            x = (bnum[g, h, k] + accn[g, h, k]) / den - o[g, h, k]
                            err += x * x
                    err_after[si, bi, g * G + h, a] = err
                kv_bytes[si, bi, g, a] = byt[g]
                kv_pages[si, bi, g, a] = cnt[g]
            for i in range(tnf.size):
                tier_nf[si, bi, a, i] = tnf[i]
                tier_nb[si, bi, a, i] = tnb[i]
