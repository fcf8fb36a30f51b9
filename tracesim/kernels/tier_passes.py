"""The per-KV-head passes of one tiers step (:func:`tracesim.kernels.tier_step.tiers_step`).

``_logits`` scores the visible positions for the group's query heads; ``_value_pass`` makes the
one pass over the values that accumulates the full-cache output, the base estimate and the
attention mass of every evicted page; ``_add_page`` adds the tokens of a page a budget fetches;
``_n_le`` counts the leading entries of a sorted array at most ``x``. Split from
:mod:`tracesim.kernels.tiers` so each module has one responsibility.
"""

from __future__ import annotations

import numba as nb
import numpy as np


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
