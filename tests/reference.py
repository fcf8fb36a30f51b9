"""Slow, plain-numpy reference implementations the compiled kernels are checked against.

Written independently of the kernels (vectorised numpy, textbook formulas), float64 throughout.
"""

from __future__ import annotations

import numpy as np


def capped_pps_iterative(x: np.ndarray, n: float) -> np.ndarray:
    """The classic iterate-and-cap loop for pi = min(1, c x), sum pi = n (no floor)."""
    x = np.asarray(x, dtype=np.float64)
    capped = np.zeros(x.size, dtype=bool)
    while True:
        rest = ~capped
        c = (n - capped.sum()) / x[rest].sum()
        pi = np.where(capped, 1.0, np.minimum(1.0, c * x))
        newly = rest & (c * x >= 1.0)
        if not newly.any():
            return pi
        capped |= newly


def hajek_reference(q, keys, values, pi, kept, scale, correction=True, fixed=False):
    """Return (estimate, V_full, m) for one query by the textbook formulas."""
    q = np.asarray(q, dtype=np.float64)
    idx = np.flatnonzero(kept)
    s = keys[idx] @ q * scale
    if correction:
        s = s - np.log(pi[idx])
    w = np.exp(s - s.max())
    a = w / w.sum()
    est = a @ values[idx]
    tail = pi[idx] < 1
    r = values[idx][tail] - est
    z = a[tail, None] * r
    c = 1 - pi[idx][tail]
    m = int(tail.sum())
    if fixed:
        if m <= 1:
            return est, np.zeros((values.shape[1],) * 2), m
        centre = (c[:, None] * z).sum(0) / c.sum()
        zc = z - centre
        V = m / (m - 1) * np.einsum("i,ij,ik->jk", c, zc, zc)
    else:
        V = np.einsum("i,ij,ik->jk", c, z, z)
    return est, V, m


def full_attention_reference(q, keys, values, scale):
    s = keys @ np.asarray(q, dtype=np.float64) * scale
    w = np.exp(s - s.max())
    return (w / w.sum()) @ values


def output_space_reference(queries, keys, values, pi, kept, o_proj, scale):
    """Brute force: explicit loops over groups, tail tokens and heads (one query each)."""
    n_heads, n_q, d = queries.shape
    n_kv = keys.shape[0]
    G = n_heads // n_kv
    total = np.zeros(n_q)
    for r in range(n_q):
        for g in range(n_kv):
            idx = np.flatnonzero(kept[g])
            heads = range(g * G, (g + 1) * G)
            weights, ests = {}, {}
            for h in heads:
                s = keys[g, idx] @ queries[h, r] * scale - np.log(pi[g, idx])
                w = np.exp(s - s.max())
                weights[h] = w / w.sum()
                ests[h] = weights[h] @ values[g, idx]
            for j, i in enumerate(idx):
                if pi[g, i] >= 1:
                    continue
                vec = np.zeros(o_proj.shape[0])
                for h in heads:
                    block = o_proj[:, h * d:(h + 1) * d]
                    vec += weights[h][j] * block @ (values[g, i] - ests[h])
                total[r] += (1 - pi[g, i]) * vec @ vec
    return total
