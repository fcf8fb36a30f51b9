"""Compiled simulator of fetch schedulers over one layer and seed (``tracesim tiers``).

One call simulates every evaluated decode step of one layer for one seed of the base policy.
The unit of work is the decode step: the steps are independent and run in parallel
(``prange``), while everything inside a step (its KV heads, schedulers and budgets) runs in a
fixed order, so the results do not depend on the number of threads.

Per step and KV head it makes two passes over the visible positions ``0..t``: the logits of the
group's query heads (keys), then one pass over the values that accumulates the full-cache
output, the base estimate's numerator and normaliser (Hájek weights ``1/pi`` on the kept
tokens, or 1), the kept tokens' softmax average and mass (for the page bound), and the
attention mass of every evicted page (with the Hájek adjustment of its sampled tokens). The
sampled (``pi < 1``) kept tokens then give the certificate and its per-page share. The value
sums of a page are never stored: once a scheduler has ordered the pages, the budgets are
processed from the smallest to the largest, each adding the pages it newly fetches from their
tokens, and a KV head whose every evicted page is fetched is the full cache.

The arguments come in five named tuples (:mod:`tracesim.kernels.tier_args`, each field's shape
documented there once): :class:`Attention`, :class:`Inclusion`, :class:`Pages`,
:class:`SchedulerTable` and :class:`TierOutputs`. Each scheduler's priority of a page is a
function of the page's :class:`~tracesim.kernels.tier_priorities.PageInputs`: built-in rules are
compiled in (``builtin_priority``), registered ones arrive as one C callback (``plugin_priority``).

The plain-numpy reference, which the tests compare this kernel with, is
:func:`tracesim.tiers.reference.simulate_layer_reference`; the definitions are in
``docs/tiers.md`` and :mod:`tracesim.tiers.schedulers`.
"""

from __future__ import annotations

from typing import Any

import numba as nb
import numpy as np

from tracesim.kernels.tier_args import Attention, Inclusion, Pages, SchedulerTable, TierOutputs
from tracesim.kernels.tier_priorities import (  # noqa: F401 - the codes are re-exported
    N_BUILTIN,
    S_BOUND,
    S_CERTIFICATE,
    S_CERTIFICATE_BOUND,
    S_CERTIFICATE_PAGE,
    S_CONFIDENCE,
    S_NONE,
    S_ORACLE,
    S_RANDOM,
    PageInputs,
    builtin_priority,
    plugin_priority,
    quiet_first_class_functions,
)

__all__ = ["Attention", "Inclusion", "Pages", "SchedulerTable", "TierOutputs", "tiers_layer",
           "tiers_step"]

#: Layers whose work (multiply-adds over steps x positions x query heads x head dim) is below
#: this run serially: a parallel region costs more than it saves on tiny layers.
SERIAL_BELOW = 1 << 22


@nb.njit(cache=True, fastmath={"reassoc", "contract"})
def _logits(Kg, qv, lo, n, scale, softcap, out, smax):
    """``out[i, h] = scale * Kg[i] . qv[h]`` (soft-capped when ``softcap > 0``) for
    ``lo <= i < n``, 0 below ``lo``; ``smax[h]`` their maximum.

    Only the dot products are reassociated (vectorised); no infinities are involved.
    """
    G, d = qv.shape
    for i in range(lo):
        for h in range(G):
            out[i, h] = 0.0
    for i in range(lo, n):
        for h in range(G):
            acc = 0.0
            for k in range(d):
                acc += Kg[i, k] * qv[h, k]
            s = acc * scale
            if softcap > 0.0:
                s = softcap * np.tanh(s / softcap)
            out[i, h] = s
            if i == lo or s > smax[h]:
                smax[h] = s


@nb.njit(cache=True)
def _n_le(arr, n, x):
    """Number of entries of the ascending ``arr[:n]`` that are ``<= x``."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if arr[mid] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@nb.njit(cache=True)
def _value_pass(e_g, Vg, lo, n, kept_g, pi_g, hajek, page, slot_g, p0, acc, accd, pd):
    """One pass over the values of positions ``[lo, n)`` (what the layer holds); returns the
    number of kept tokens among them.

    ``acc[c, h] += e[i, h] v_i`` and ``accd[c, h] += e[i, h]`` over the tokens of class ``c``:
    0 kept with ``pi = 1``, 1 kept with ``pi < 1`` (sampled), 2 evicted; with ``hajek``,
    ``acc[3]``, ``accd[3]`` add the sampled tokens with weight ``e / pi``. ``pd[p0 + slot, h]``
    adds each evicted token's ``e`` to its page. Every other sum is a combination of these.
    """
    G, d = e_g.shape[1], Vg.shape[1]
    m = 0
    for i in range(lo, n):
        if kept_g[i]:
            m += 1
            c = 0
            if pi_g[i] < 1.0:
                c = 1
                if hajek:
                    inv = 1.0 / pi_g[i]
                    for h in range(G):
                        w = e_g[i, h] * inv
                        accd[3, h] += w
                        for k in range(d):
                            acc[3, h, k] += w * Vg[i, k]
        else:
            c = 2
            p = p0 + slot_g[i // page]
            for h in range(G):
                pd[p, h] += e_g[i, h]
        for h in range(G):
            ev = e_g[i, h]
            accd[c, h] += ev
            for k in range(d):
                acc[c, h, k] += ev * Vg[i, k]
    return m


@nb.njit(cache=True)
def _add_page(Vg, e_g, kept_g, pi_g, hajek, start, stop, accn, accd):
    """Add one fetched page's value sums: its evicted tokens with weight 1, and (Hájek) its
    sampled kept tokens with ``1 - 1/pi`` (they lose their ``1/pi`` weight)."""
    G, d = accn.shape
    for i in range(start, stop):
        if kept_g[i]:
            if not hajek or pi_g[i] >= 1.0:
                continue
            c = 1.0 - 1.0 / pi_g[i]
            for h in range(G):
                ev = e_g[i, h] * c
                accd[h] += ev
                for k in range(d):
                    accn[h, k] += ev * Vg[i, k]
        else:
            for h in range(G):
                ev = e_g[i, h]
                accd[h] += ev
                for k in range(d):
                    accn[h, k] += ev * Vg[i, k]


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


@nb.njit(cache=True, parallel=True)
def _layer_parallel(att, inc, pages, schedule, out, plugin):
    # not called ``sched``: numba's parallel loop gives that name to its own work schedule
    for a in nb.prange(att.qpos.size):
        # an int64 step index, so the serial and parallel kernels share one compiled step
        step = np.int64(a)
        tiers_step(step, att, inc, pages, schedule, out, plugin)


@nb.njit(cache=True)
def _layer_serial(att, inc, pages, schedule, out, plugin):
    for a in range(att.qpos.size):
        tiers_step(a, att, inc, pages, schedule, out, plugin)


def tiers_layer(att: Attention, inc: Inclusion, pages: Pages, schedule: SchedulerTable,
                n_tiers: int, want_order: bool = False,
                plugin: Any = None) -> dict[str, np.ndarray]:
    """Simulate every decode step of one layer for one seed.

    Parameters
    ----------
    att : Attention
        Keys, values, the evaluated decode queries, their positions and the softmax scale.
    inc : Inclusion
        The base policy's inclusion probabilities and kept set.
    pages : Pages
        The evicted pages and their summaries.
    schedule : SchedulerTable
        Schedulers, fetch budgets and what the schedulers read.
    n_tiers : int
        Lower tiers.
    want_order : bool
        Also return each scheduler's fetch order (``order``).
    plugin : numba.cfunc, optional
        The callback of the registered rules among ``schedule.codes``
        (:func:`tracesim.kernels.tier_priorities.plugin_priority`); none by default.

    Returns
    -------
    dict of str -> ndarray
        The fields of :class:`TierOutputs` by name (shapes documented there).
    """
    n_kv = att.K.shape[0]
    H, NQ, d = att.Q.shape[0], att.qpos.size, att.K.shape[2]
    NS, NB = schedule.codes.size, schedule.budgets.size
    out = TierOutputs(
        err_before=np.zeros((H, NQ)), cert=np.zeros((H, NQ)),
        err_after=np.zeros((NS, NB, H, NQ)), kv_bytes=np.zeros((NS, NB, n_kv, NQ)),
        kv_pages=np.zeros((NS, NB, n_kv, NQ)), evicted=np.zeros((n_kv, NQ)),
        tier_nf=np.zeros((NS, NB, NQ, n_tiers)), tier_nb=np.zeros((NS, NB, NQ, n_tiers)),
        kept_tokens=np.zeros(NQ, dtype=np.int64),
        order=np.full((NS, NQ, pages.off[-1]) if want_order else (0, 0, 0), -1,
                      dtype=np.int64),
        nsel=np.zeros((NS, NB, NQ), dtype=np.int64))
    work = int(np.sum(att.qpos + 1)) * H * d
    # one step (the in-loop fetch) has nothing to run in parallel
    fn = _layer_serial if work < SERIAL_BELOW or NQ == 1 else _layer_parallel
    sinks = np.full(H, -np.inf) if att.sinks is None else att.sinks
    att = att._replace(qpos=np.ascontiguousarray(att.qpos, dtype=np.int64),
                       scale=float(att.scale), softcap=float(att.softcap or 0.0),
                       window=int(att.window or 0),
                       sinks=np.ascontiguousarray(sinks, dtype=np.float64))
    inc = inc._replace(hajek=bool(inc.hajek), certified=bool(inc.certified))
    pages = pages._replace(page=int(pages.page))
    schedule = schedule._replace(need_bound=bool(schedule.need_bound),
                           need_uniforms=bool(schedule.need_uniforms))
    with quiet_first_class_functions():
        fn(att, inc, pages, schedule, out, plugin_priority(()) if plugin is None else plugin)
    return out._asdict()
