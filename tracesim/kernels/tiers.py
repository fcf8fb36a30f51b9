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

The plain-numpy reference, which the tests compare this kernel with, is
:func:`tracesim.tiers.reference.simulate_layer_reference`; the definitions are in
``docs/tiers.md`` and :mod:`tracesim.tiers.schedulers`.
"""

from __future__ import annotations

import numba as nb
import numpy as np

#: Scheduler codes: the index of the name in :data:`tracesim.tiers.schedulers.SCHEDULERS`.
(S_NONE, S_RANDOM, S_CONFIDENCE, S_CERTIFICATE, S_CERTIFICATE_PAGE, S_BOUND, S_ORACLE,
 S_CERTIFICATE_BOUND) = range(8)
#: Layers whose work (multiply-adds over steps x positions x query heads x head dim) is below
#: this run serially: a parallel region costs more than it saves on tiny layers.
SERIAL_BELOW = 1 << 22


@nb.njit(cache=True, fastmath={"reassoc", "contract"})
def _logits(Kg, qv, n, scale, out, smax):
    """``out[i, h] = scale * Kg[i] . qv[h]`` for ``i < n``; ``smax[h]`` their maximum.

    Only the dot products are reassociated (vectorised); no infinities are involved.
    """
    G, d = qv.shape
    for i in range(n):
        for h in range(G):
            acc = 0.0
            for k in range(d):
                acc += Kg[i, k] * qv[h, k]
            s = acc * scale
            out[i, h] = s
            if i == 0 or s > smax[h]:
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
def _value_pass(e_g, Vg, n, kept_g, pi_g, hajek, page, slot_g, p0, acc, accd, pd):
    """One pass over the values of positions ``< n``; returns the number of kept tokens.

    ``acc[c, h] += e[i, h] v_i`` and ``accd[c, h] += e[i, h]`` over the tokens of class ``c``:
    0 kept with ``pi = 1``, 1 kept with ``pi < 1`` (sampled), 2 evicted; with ``hajek``,
    ``acc[3]``, ``accd[3]`` add the sampled tokens with weight ``e / pi``. ``pd[p0 + slot, h]``
    adds each evicted token's ``e`` to its page. Every other sum is a combination of these.
    """
    G, d = e_g.shape[1], Vg.shape[1]
    m = 0
    for i in range(n):
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
def tiers_step(a, K, V, Q, qpos, scale, pi, kept, hajek, certified, page, pg_off, pg_first,
               pg_count, pg_kmin, pg_kmax, pg_vcen, pg_vrad, pg_bytes, pg_tier, block_slot,
               tail_off, tail_pos, codes, budgets, conf_w, rprio, need_bound, err_before, cert,
               err_after, kv_bytes, kv_pages, evicted, tier_nf, tier_nb, kept_tok, order_out,
               nsel_out):
    """Simulate decode step ``a`` (see :func:`tiers_layer` for the arguments)."""
    n_kv, _, d = K.shape
    H = Q.shape[0]
    G = H // n_kv
    NP = pg_off[n_kv]
    NS, NB = codes.size, budgets.size
    t = qpos[a]
    n = t + 1
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
        for h in range(G):
            for k in range(d):
                qv[h, k] = Q[g * G + h, a, k]
        e_g = e[g]
        _logits(K[g], qv, n, scale, e_g, smax)
        for i in range(n):
            for h in range(G):
                e_g[i, h] = np.exp(e_g[i, h] - smax[h])
        Vg = V[g]
        acc[:] = 0.0
        accd[:] = 0.0
        ktok += _value_pass(e_g, Vg, n, kept[g], pi[g], hajek, page, block_slot[g], p0, acc,
                            accd, pd)
        wb = 3 if hajek else 1                # the sampled tokens' class in the estimate
        for h in range(G):
            etot[g, h] = accd[0, h] + accd[1, h] + accd[2, h]
            er[h] = accd[0, h] + accd[1, h]
            bden[g, h] = accd[0, h] + accd[wb, h]
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
        for p in range(p0, p0 + nv):
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
            for p in range(p0, p0 + nv):
                bt = 0.0
                for h in range(G):
                    top = 0.0
                    for k in range(d):
                        top += max(pg_kmin[p, k] * qv[h, k], pg_kmax[p, k] * qv[h, k])
                    u = scale * top - smax[h]
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
        for p in range(pg_off[g], pg_off[g] + nvis[g]):
            cand[nc] = p
            nc += 1
    total = 0.0
    for p in range(NP):
        total += pg_bytes[p]
    npages = np.empty(n_kv, np.int64)
    btot = np.zeros(n_kv)
    for g in range(n_kv):
        npages[g] = pg_off[g + 1] - pg_off[g]
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
            if code == S_RANDOM or code == S_CONFIDENCE:
                prio[p] = rprio[a, p]
            elif code == S_BOUND:
                prio[p] = bterm[p]
            elif code == S_ORACLE:
                prio[p] = orc[p]
            elif code == S_CERTIFICATE:
                frac = bterm[p] / btot[g] if btot[g] > 0 else 1.0 / max(1, npages[g])
                prio[p] = c2[g] * frac
            elif code == S_CERTIFICATE_PAGE:
                frac = bterm[p] / btot[g] if btot[g] > 0 else 0.0
                prio[p] = pc[p] + 1e-9 * c2[g] * frac
            elif code == S_CERTIFICATE_BOUND:
                prio[p] = (pc[p] / pctot if pctot > 0 else 0.0) + (
                    bterm[p] / bsum if bsum > 0 else 0.0)
        n_order = 0 if code == S_NONE else nc
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
                w = conf_w[a] if code == S_CONFIDENCE else 1.0
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
                    _add_page(V[g], e[g], kept[g], pi[g], hajek, start, min(start + page, n),
                              accn[g], accd[g])
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
def _layer_parallel(K, V, Q, qpos, scale, pi, kept, hajek, certified, page, pg_off, pg_first,
                    pg_count, pg_kmin, pg_kmax, pg_vcen, pg_vrad, pg_bytes, pg_tier, block_slot,
                    tail_off, tail_pos, codes, budgets, conf_w, rprio, need_bound, err_before,
                    cert, err_after, kv_bytes, kv_pages, evicted, tier_nf, tier_nb, kept_tok,
                    order_out, nsel_out):
    for a in nb.prange(qpos.size):
        # an int64 step index, so the serial and parallel kernels share one compiled step
        step = np.int64(a)
        tiers_step(step, K, V, Q, qpos, scale, pi, kept, hajek, certified, page, pg_off, pg_first,
                   pg_count, pg_kmin, pg_kmax, pg_vcen, pg_vrad, pg_bytes, pg_tier, block_slot,
                   tail_off, tail_pos, codes, budgets, conf_w, rprio, need_bound, err_before,
                   cert, err_after, kv_bytes, kv_pages, evicted, tier_nf, tier_nb, kept_tok,
                   order_out, nsel_out)


@nb.njit(cache=True)
def _layer_serial(K, V, Q, qpos, scale, pi, kept, hajek, certified, page, pg_off, pg_first,
                  pg_count, pg_kmin, pg_kmax, pg_vcen, pg_vrad, pg_bytes, pg_tier, block_slot,
                  tail_off, tail_pos, codes, budgets, conf_w, rprio, need_bound, err_before,
                  cert, err_after, kv_bytes, kv_pages, evicted, tier_nf, tier_nb, kept_tok,
                  order_out, nsel_out):
    for a in range(qpos.size):
        tiers_step(a, K, V, Q, qpos, scale, pi, kept, hajek, certified, page, pg_off, pg_first,
                   pg_count, pg_kmin, pg_kmax, pg_vcen, pg_vrad, pg_bytes, pg_tier, block_slot,
                   tail_off, tail_pos, codes, budgets, conf_w, rprio, need_bound, err_before,
                   cert, err_after, kv_bytes, kv_pages, evicted, tier_nf, tier_nb, kept_tok,
                   order_out, nsel_out)


def tiers_layer(K: np.ndarray, V: np.ndarray, Q: np.ndarray, qpos: np.ndarray, scale: float,
                pi: np.ndarray, kept: np.ndarray, hajek: bool, certified: bool, page: int,
                pages: dict[str, np.ndarray], block_slot: np.ndarray, tail_off: np.ndarray,
                tail_pos: np.ndarray, codes: np.ndarray, budgets: np.ndarray,
                conf_w: np.ndarray, rprio: np.ndarray, need_bound: bool, n_tiers: int,
                want_order: bool = False) -> dict[str, np.ndarray]:
    """Simulate every decode step of one layer for one seed.

    Parameters
    ----------
    K, V : ndarray of float64, shape (n_kv, N, d)
        Keys and values.
    Q : ndarray of float64, shape (H, NQ, d)
        The evaluated decode queries (``H = n_kv * G``, query head ``h`` reads KV head
        ``h // G``).
    qpos : ndarray of int64, shape (NQ,)
        Their positions ``t`` (the step sees positions ``0..t``).
    scale : float
        Softmax scale.
    pi : ndarray of float64, shape (n_kv, N)
        Inclusion probabilities of the base policy.
    kept : ndarray of bool, shape (n_kv, N)
        Its kept set.
    hajek, certified : bool
        Hájek weights ``1/pi`` on the kept tokens; the certificate is computed.
    page : int
        Positions per page.
    pages : dict
        The evicted pages of all KV heads, head by head in position order (``NP`` in all):
        ``off`` (n_kv + 1,) page offsets per head, ``first`` (NP,) first evicted position,
        ``count`` (NP,) evicted tokens, ``kmin``, ``kmax``, ``vcen`` (NP, d), ``vrad`` (NP,)
        their summaries (:func:`tracesim.bounds.pages.build_page_summaries`), ``bytes`` (NP,)
        and ``tier`` (NP,) the lower tier each lives in.
    block_slot : ndarray of int64, shape (n_kv, ceil(N / page))
        Index within its head of the page of each block of positions, -1 for none.
    tail_off, tail_pos : ndarray of int64
        Sampled kept positions (``pi < 1``) of each head, ascending:
        ``tail_pos[tail_off[g]:tail_off[g + 1]]``.
    codes : ndarray of int64, shape (NS,)
        Scheduler codes (``S_*``).
    budgets : ndarray of float64, shape (NB,)
        Fetch budgets, fractions of the layer's evicted bytes.
    conf_w : ndarray of float64, shape (NQ,)
        Budget multipliers of the ``confidence`` scheduler.
    rprio : ndarray of float64, shape (NQ, NP)
        Permanent uniforms of the ``random`` and ``confidence`` orders (any shape when neither
        runs).
    need_bound : bool
        Compute the page bound (the ``bound``, ``certificate`` and ``certificate_page``
        schedulers read it).
    n_tiers : int
        Lower tiers.
    want_order : bool
        Also return each scheduler's fetch order (``order``).

    Returns
    -------
    dict of str -> ndarray
        ``err_before``, ``cert`` (H, NQ); ``err_after`` (NS, NB, H, NQ); ``kv_bytes``,
        ``kv_pages`` (NS, NB, n_kv, NQ); ``evicted`` (n_kv, NQ); ``tier_nf``, ``tier_nb``
        (NS, NB, NQ, n_tiers): fetches and bytes per tier; ``kept_tokens`` (NQ,); ``nsel``
        (NS, NB, NQ): pages fetched; with ``want_order``, ``order`` (NS, NQ, NP): the visible
        pages in fetch order (indices into ``pages``), so budget ``bi`` fetches
        ``order[si, a, :nsel[si, bi, a]]``.
    """
    n_kv, _, d = K.shape
    H, NQ = Q.shape[0], qpos.size
    NS, NB = codes.size, budgets.size
    out = {"err_before": np.zeros((H, NQ)), "cert": np.zeros((H, NQ)),
           "err_after": np.zeros((NS, NB, H, NQ)), "kv_bytes": np.zeros((NS, NB, n_kv, NQ)),
           "kv_pages": np.zeros((NS, NB, n_kv, NQ)), "evicted": np.zeros((n_kv, NQ)),
           "tier_nf": np.zeros((NS, NB, NQ, n_tiers)), "tier_nb": np.zeros((NS, NB, NQ, n_tiers)),
           "kept_tokens": np.zeros(NQ, dtype=np.int64),
           "nsel": np.zeros((NS, NB, NQ), dtype=np.int64),
           "order": np.full((NS, NQ, pages["off"][-1]) if want_order else (0, 0, 0), -1,
                            dtype=np.int64)}
    work = int(np.sum(qpos + 1)) * H * d
    # one step (the in-loop fetch) has nothing to run in parallel
    fn = _layer_serial if work < SERIAL_BELOW or NQ == 1 else _layer_parallel
    fn(K, V, Q, np.ascontiguousarray(qpos, dtype=np.int64), float(scale), pi, kept,
       bool(hajek), bool(certified), int(page), pages["off"], pages["first"], pages["count"],
       pages["kmin"], pages["kmax"], pages["vcen"], pages["vrad"], pages["bytes"],
       pages["tier"], block_slot, tail_off, tail_pos, codes, budgets, conf_w, rprio,
       bool(need_bound), out["err_before"], out["cert"], out["err_after"], out["kv_bytes"],
       out["kv_pages"], out["evicted"], out["tier_nf"], out["tier_nb"], out["kept_tokens"],
       out["order"], out["nsel"])
    return out
