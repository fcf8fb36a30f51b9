"""Exact float64 causal attention over long key sequences, blocked over keys.

Never materializes a ``(queries x positions)`` matrix larger than ``queries x block``: outputs
use the online-softmax recurrence (running max ``m``, normalizer ``l``, rescaled numerator),
and accumulated attention (the H2O statistic) takes a second pass once ``m`` and ``l`` are
known.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BLOCK", "causal_attention", "weighted_attention_sums"]

#: Keys per block (the working set is about ``n_queries * BLOCK * 8`` bytes).
BLOCK = 8192


def _logits(q: np.ndarray, qpos: np.ndarray, keys: np.ndarray, start: int, scale: float,
            window: int | None = None, softcap: float | None = None) -> np.ndarray:
    k = np.asarray(keys, dtype=np.float64)
    s = (q @ k.T) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    kpos = np.arange(start, start + k.shape[0])
    s[kpos[None, :] > qpos[:, None]] = -np.inf
    if window is not None:  # a sliding layer: the query at t attends (t - window, t]
        s[kpos[None, :] <= (qpos - window)[:, None]] = -np.inf
    return s


def causal_attention(
    q: np.ndarray, qpos: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float,
    *, block: int = BLOCK, window: int | None = None, softcap: float | None = None,
    sinks: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Causal softmax attention of queries at ``qpos`` over keys at positions ``0..P-1``.

    Parameters
    ----------
    q : ndarray, shape (n, d)
        Queries (float64).
    qpos : ndarray of int, shape (n,)
        Query positions; a query sees keys at positions ``<= qpos``.
    keys, values : ndarray, shape (P, d)
        Any float dtype; read one block at a time and converted to float64.
    scale : float
    block : int
        Keys per block.
    window, softcap : optional
        A sliding layer's window (the query at ``t`` attends ``(t - window, t]``) and the
        logit soft-cap ``c * tanh(s / c)``.
    sinks : ndarray, shape (n,), optional
        Each row's sink logit: ``exp(sink)`` joins the denominator with value zero.

    Returns
    -------
    out : ndarray, shape (n, d)
        Attention outputs, float64.
    m, l : ndarray, shape (n,)
        Row maximum of the logits and ``sum_j exp(s_j - m)`` (plus ``exp(sink - m)``).
    """
    n, d = q.shape
    P = keys.shape[0]
    qpos = np.asarray(qpos, dtype=np.int64)
    m = np.full(n, -np.inf)
    l = np.zeros(n)
    acc = np.zeros((n, values.shape[1]))
    last = int(qpos.max()) + 1 if n else 0
    for a in range(0, min(P, last), block):
        b = min(P, a + block, last)
        s = _logits(q, qpos, keys[a:b], a, scale, window, softcap)
        m_new = np.maximum(m, s.max(axis=1))
        seen = np.isfinite(m_new)
        alpha = np.where(seen, np.exp(m - np.where(seen, m_new, 0.0)), 0.0)
        p = np.exp(s - np.where(seen, m_new, 0.0)[:, None])
        l = l * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + p @ np.asarray(values[a:b], dtype=np.float64)
        m = m_new
    if (l <= 0).any():
        raise ValueError("a query sees no key (query position < 0?)")
    if sinks is not None:
        l = l + np.exp(np.asarray(sinks, dtype=np.float64) - m)
    return acc / l[:, None], m, l


def weighted_attention_sums(
    q: np.ndarray, qpos: np.ndarray, weights: np.ndarray, keys: np.ndarray, scale: float,
    m: np.ndarray, l: np.ndarray, n_groups: int, *, block: int = BLOCK,
    window: int | None = None, softcap: float | None = None,
) -> np.ndarray:
    """``sum_r weights[r] * softmax_r`` per group of rows: accumulated attention per key.

    Parameters
    ----------
    q, qpos : as for :func:`causal_attention`
        Rows are ``n_groups`` consecutive groups of equal size (one group per query head).
    weights : ndarray, shape (n / n_groups,)
        Weight of each row within its group.
    keys : ndarray, shape (P, d)
    m, l : ndarray, shape (n,)
        From :func:`causal_attention` on the same queries and keys.

    Returns
    -------
    ndarray, shape (n_groups, P)
        Float64; group ``g``'s row sums to ``weights.sum()``.
    """
    n = q.shape[0]
    per = n // n_groups
    P = keys.shape[0]
    out = np.zeros((n_groups, P))
    last = int(qpos.max()) + 1 if n else 0
    w = np.tile(np.asarray(weights, dtype=np.float64), n_groups) / l
    for a in range(0, min(P, last), block):
        b = min(P, a + block, last)
        p = np.exp(_logits(q, qpos, keys[a:b], a, scale, window, softcap)
                   - m[:, None]) * w[:, None]
        out[:, a:b] = p.reshape(n_groups, per, b - a).sum(axis=1)
    return out
