"""Compiled pass for the page-summary bound (``docs/math.md``, section 9).

Runs after the main replay kernel, over the same iterations (policy, seed) and events. For each
(iteration, KV head, event) it rebuilds the kept set exactly as the main kernel does
(``u < pi``, or the fixed-size design's mask), summarises the missing tokens in pages, and for
every query of the event and head of the group recomputes the policy's estimate from the kept
tokens (Hájek offsets ``-log pi`` or none) and bounds ``|o_hat - o|``. Only kept keys/values, the
query and the summaries enter the bound; the truth is never read.

The numpy reference is :func:`tracesim.bounds.attention_error_bound`. The operands come in the
documented groups of :mod:`tracesim.kernels.bound_args`.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from tracesim.kernels.bound_args import (
    BoundScratch,
    KeptHead,
    MissingPages,
)

# Fields of ``out[iteration, head, query, :]``.
B_BOUND, B_MASS, B_TOKENS = 0, 1, 2
N_BOUND_FIELDS = 3
#: Floating-point allowance relative to the largest value norm (as tracesim.bounds.ROUNDING).
ROUNDING = 1e-10


@nb.njit(cache=True)
def build_pages(Kg, Vg, keep, tmax, page, kmin, kmax, vcen, vrad, count, first, last):
    """Summaries of the missing positions ``<= tmax`` in pages; returns the number of pages.

    Output arrays are sized for ``ceil((tmax + 1) / page)`` pages; only the first ``n`` (the
    non-empty pages, ascending) are filled.
    """
    d = Kg.shape[1]
    n = 0
    end = min(tmax + 1, Kg.shape[0])
    start = 0
    while start < end:
        stop = min(start + page, end)
        c = 0
        for p in range(start, stop):
            if keep[p]:
                continue
            if c == 0:
                first[n] = p
                for k in range(d):
                    kmin[n, k] = Kg[p, k]
                    kmax[n, k] = Kg[p, k]
                    vcen[n, k] = 0.0
            else:
                for k in range(d):
                    kmin[n, k] = min(kmin[n, k], Kg[p, k])
                    kmax[n, k] = max(kmax[n, k], Kg[p, k])
            for k in range(d):
                vcen[n, k] += Vg[p, k]
            last[n] = p
            c += 1
        if c > 0:
            for k in range(d):
                vcen[n, k] /= c
            r2 = 0.0
            for p in range(start, stop):
                if keep[p]:
                    continue
                acc = 0.0
                for k in range(d):
                    x = Vg[p, k] - vcen[n, k]
                    acc += x * x
                r2 = max(r2, acc)
            vrad[n] = np.sqrt(r2)
            count[n] = c
            n += 1
        start = stop
    return n


@nb.njit(cache=True)
def ratio_box_max(num0, den0, slope, width, n):
    """``max (num0 + sum D_b x_b) / (den0 + sum x_b)`` over ``0 <= x_b <= width_b`` (b < n)."""
    order = np.argsort(-slope[:n], kind="mergesort")
    num = num0
    den = den0
    best = num / den if den > 0.0 else -np.inf
    for i in range(n):
        b = order[i]
        if width[b] <= 0.0:
            continue
        if den > 0.0 and slope[b] <= best:
            break
        num += slope[b] * width[b]
        den += width[b]
        best = num / den
    return best if best > -np.inf else 0.0


@nb.njit(cache=True)
def row_bound(qv, t, head, pages, scratch):
    """Bound ``|o_hat - o|`` and the missing mass for one query.

    ``qv`` (d,) is the query at position ``t``; ``head`` a :class:`KeptHead`, ``pages`` its
    :class:`MissingPages`, ``scratch`` a :class:`BoundScratch`. Returns ``(bound, mass)``.
    """
    Kg, Vg, scale, kept_idx, m, pi_row, corrected = head
    n_pages, kmin, kmax, vcen, vrad, count, first, last = pages
    s, o_r, o_h, hi, lo, dist = scratch
    d = Kg.shape[1]
    top = -np.inf
    mv = 0
    for j in range(m):
        p = kept_idx[j]
        if p > t:
            continue
        acc = 0.0
        for k in range(d):
            acc += qv[k] * Kg[p, k]
        s[mv] = scale * acc
        top = max(top, s[mv])
        mv += 1
    top_r = top
    npv = 0
    for b in range(n_pages):
        if first[b] > t:
            break
        up = 0.0
        dn = 0.0
        for k in range(d):
            a1 = qv[k] * kmin[b, k]
            a2 = qv[k] * kmax[b, k]
            up += max(a1, a2)
            dn += min(a1, a2)
        hi[b] = scale * up
        lo[b] = scale * dn if last[b] <= t else -np.inf
        top = max(top, hi[b])
        npv += 1
    if not top > -np.inf:
        top = 0.0
    e_r = 0.0
    zh = 0.0
    for k in range(d):
        o_r[k] = 0.0
        o_h[k] = 0.0
    vmax = 0.0
    mv = 0
    for j in range(m):
        p = kept_idx[j]
        if p > t:
            continue
        x = np.exp(s[mv] - top_r)
        xh = x / pi_row[p] if (corrected and pi_row[p] < 1.0) else x
        e_r += x
        zh += xh
        vn = 0.0
        for k in range(d):
            o_r[k] += x * Vg[p, k]
            o_h[k] += xh * Vg[p, k]
            vn += Vg[p, k] * Vg[p, k]
        vmax = max(vmax, np.sqrt(vn))
        mv += 1
    a = 0.0
    on = 0.0
    for k in range(d):
        o_r[k] = o_r[k] / e_r if e_r > 0.0 else 0.0
        o_h[k] = o_h[k] / zh if zh > 0.0 else 0.0
        a += (o_r[k] - o_h[k]) ** 2
        on += o_h[k] * o_h[k]
    a = np.sqrt(a) if e_r > 0.0 else 0.0
    vmax = max(vmax, np.sqrt(on))
    # Weights above used the kept tokens' own shift (exact o_R and o_hat); E_R on the common one.
    e_r = e_r * np.exp(top_r - top) if mv > 0 else 0.0
    num0 = e_r * a
    den0 = e_r
    hsum = 0.0
    for b in range(npv):
        dd = 0.0
        cn = 0.0
        for k in range(d):
            x = vcen[b, k] - o_h[k]
            dd += x * x
            cn += vcen[b, k] * vcen[b, k]
        dist[b] = np.sqrt(dd) + vrad[b]
        vmax = max(vmax, np.sqrt(cn) + vrad[b])
        up = count[b] * np.exp(hi[b] - top)
        low = count[b] * np.exp(lo[b] - top)
        num0 += dist[b] * low
        den0 += low
        hi[b] = up - low
        hsum += up
    bound = ratio_box_max(num0, den0, dist, hi, npv)
    mass = hsum / (e_r + hsum) if hsum > 0.0 else 0.0
    return bound + ROUNDING * vmax, mass


@nb.njit(cache=True, parallel=True)
def bound_kernel(layer, iters, out):
    """Bound of every (iteration, head, evaluated query); NaN where the policy's page is 0.

    ``layer`` a :class:`BoundLayer`, ``iters`` a :class:`BoundIterations`; ``out`` (n_iter, H,
    NQ, N_BOUND_FIELDS) float64 receives the rows (fields ``B_*``).
    """
    Q, K, V, qpos, scale, pi, ev_qptr, ev_q, slot_ev, kmask, u = layer
    it_cfg, it_seed, it_slot, it_kslot, corrected, page = iters
    H, NQ, d = Q.shape
    n_kv, P, _ = K.shape
    G = H // n_kv
    for it in nb.prange(it_cfg.size):
        c = it_cfg[it]
        pg = page[c]
        if pg <= 0:
            for h in range(H):
                for q in range(NQ):
                    for f in range(N_BOUND_FIELDS):
                        out[it, h, q, f] = np.nan
            continue
        s_i = it_seed[it]
        slot = it_slot[it]
        ks = it_kslot[it]
        nmax = (P + pg - 1) // pg
        kmin = np.empty((nmax, d))
        kmax = np.empty((nmax, d))
        vcen = np.empty((nmax, d))
        vrad = np.empty(nmax)
        count = np.empty(nmax)
        first = np.empty(nmax, dtype=np.int64)
        last = np.empty(nmax, dtype=np.int64)
        keep = np.empty(P, dtype=np.bool_)
        kept_idx = np.empty(P, dtype=np.int64)
        s = np.empty(P)
        o_r = np.empty(d)
        o_h = np.empty(d)
        hi = np.empty(nmax)
        lo = np.empty(nmax)
        dist = np.empty(nmax)
        scratch = BoundScratch(s, o_r, o_h, hi, lo, dist)
        for g in range(n_kv):
            for e in range(slot_ev[slot], slot_ev[slot + 1]):
                qrows = ev_q[ev_qptr[e]:ev_qptr[e + 1]]
                if qrows.size == 0:
                    continue
                m = 0
                for p in range(P):
                    k = (kmask[ks, g, p] != 0) if ks >= 0 else (u[s_i, g, p] < pi[e, g, p])
                    keep[p] = k
                    if k:
                        kept_idx[m] = p
                        m += 1
                tmax = 0
                for a in range(qrows.size):
                    tmax = max(tmax, qpos[qrows[a]])
                n_pages = build_pages(K[g], V[g], keep, tmax, pg, kmin, kmax, vcen, vrad, count,
                                      first, last)
                tokens = n_pages * (3.0 * d + 3.0) / (2.0 * d)
                head = KeptHead(K[g], V[g], scale, kept_idx, m, pi[e, g], corrected[c])
                pages = MissingPages(n_pages, kmin, kmax, vcen, vrad, count, first, last)
                for a in range(qrows.size):
                    q = qrows[a]
                    for hh in range(G):
                        h = g * G + hh
                        b, mass = row_bound(Q[h, q], qpos[q], head, pages, scratch)
                        out[it, h, q, B_BOUND] = b
                        out[it, h, q, B_MASS] = mass
                        out[it, h, q, B_TOKENS] = tokens
