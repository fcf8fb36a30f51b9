"""The generative model of ``tracesim synth``: keys, values and queries with known structure.

Every logit ``scale * q . k`` is a sum of interpretable parts, built from orthogonal pieces of the
head dimension (``d/2`` content dimensions, ``d/2`` positional dimensions); see ``docs/synth.md``:

* noise: Gaussian content vectors, logit standard deviation 1;
* attention sinks: the first :data:`N_SINKS` keys carry a large component along a per-KV-head
  sink direction that every query of the group follows (logit boost ``b_sink`` per head);
* heavy hitters: a random :data:`HEAVY_FRACTION` of the keys carry a component along a
  heavy-hitter direction (boost ``b_heavy * u_j``, ``u_j ~ U(0.5, 1)``);
* a local window: RoPE-style rotations of a constant vector in the positional dimensions, so the
  logit gains ``b_local * mean_f cos(theta_f (t - j))``, which decays over about
  :data:`LOCAL_WINDOW` positions;
* retrieval heads: on a random :data:`RETRIEVAL_FRACTION` of the query heads, every decode query
  adds a spike along the (stored) key of one random far token, scaled so that the token's logit
  exceeds the log-sum-exp of all other visible logits by :data:`RETRIEVAL_MARGIN` (the token
  then takes about 95% of the attention).

Model properties (directions, per-head strengths, retrieval heads, o_proj) depend only on
``(seed, layer)``; token-level draws depend on ``(seed, sequence, layer, head, chunk)``, so a store
is reproducible from its seed whatever the order of work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "CHUNK",
    "HEAVY_FRACTION",
    "LOCAL_WINDOW",
    "N_SINKS",
    "RETRIEVAL_FRACTION",
    "RETRIEVAL_MARGIN",
    "LayerModel",
    "key_chunk",
    "layer_model",
    "queries",
    "rng_for",
]

N_SINKS = 4
HEAVY_FRACTION = 0.01
LOCAL_WINDOW = 64
RETRIEVAL_FRACTION = 0.125
RETRIEVAL_MARGIN = 3.0
#: Positions drawn per random-number stream when generating keys and values (fixed, so the
#: store does not depend on how the work is chunked in memory).
CHUNK = 16384

# Stream ids of rng_for.
_MODEL, _KEYS, _QUERIES, _OPROJ, _ROW, _H2O = range(6)


def rng_for(seed: int, *keys: int) -> np.random.Generator:
    """Independent generator for ``(seed, *keys)`` (all non-negative ints)."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), *map(int, keys)]))


@dataclass(frozen=True)
class LayerModel:
    """Per-layer model parameters (independent of the sequence).

    Attributes
    ----------
    sink_dir, heavy_dir : ndarray, shape (n_kv_heads, d)
        Orthonormal content directions per KV head (zero in the positional dimensions).
    b_sink, b_heavy, b_local : ndarray, shape (n_heads,)
        Logit boosts per query head (logit units).
    retrieval : ndarray of bool, shape (n_heads,)
        Retrieval heads.
    theta : ndarray, shape (d_pos / 2,)
        Rotation frequencies of the positional dimensions (radians per position).
    """

    head_dim: int
    n_heads: int
    n_kv_heads: int
    scale: float
    sink_dir: np.ndarray
    heavy_dir: np.ndarray
    b_sink: np.ndarray
    b_heavy: np.ndarray
    b_local: np.ndarray
    retrieval: np.ndarray
    theta: np.ndarray

    @property
    def d_content(self) -> int:
        return self.head_dim // 2

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads


def layer_model(seed: int, layer: int, n_heads: int, n_kv_heads: int, head_dim: int) -> LayerModel:
    """Draw the parameters of one layer (see the module docstring)."""
    if head_dim < 4:
        raise ValueError(f"head_dim = {head_dim}: expected at least 4")
    rng = rng_for(seed, _MODEL, layer)
    dc = head_dim // 2
    sink = np.zeros((n_kv_heads, head_dim))
    heavy = np.zeros((n_kv_heads, head_dim))
    for g in range(n_kv_heads):
        basis, _ = np.linalg.qr(rng.standard_normal((dc, 2)))
        sink[g, :dc], heavy[g, :dc] = basis[:, 0], basis[:, 1]
    n_retrieval = max(1, round(RETRIEVAL_FRACTION * n_heads))
    retrieval = np.zeros(n_heads, dtype=bool)
    retrieval[rng.choice(n_heads, size=n_retrieval, replace=False)] = True
    n_freq = (head_dim - dc) // 2
    # Geometric frequencies from 1 radian/position down to one turn per 4 windows.
    theta = np.geomspace(1.0, 2 * np.pi / (4 * LOCAL_WINDOW), n_freq)
    return LayerModel(
        head_dim=head_dim, n_heads=n_heads, n_kv_heads=n_kv_heads, scale=head_dim**-0.5,
        sink_dir=sink, heavy_dir=heavy,
        b_sink=rng.uniform(6.0, 11.0, n_heads), b_heavy=rng.uniform(1.0, 4.0, n_heads),
        b_local=rng.uniform(1.0, 5.0, n_heads), retrieval=retrieval, theta=theta)


def _rotary(positions: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """``(n, 2 * n_freq)`` interleaved ``cos, sin`` of ``position * theta``."""
    angle = positions[:, None].astype(np.float64) * theta[None, :]
    out = np.empty((positions.size, 2 * theta.size))
    out[:, 0::2], out[:, 1::2] = np.cos(angle), np.sin(angle)
    return out


def key_chunk(m: LayerModel, seed: int, sequence: int, layer: int, kv_head: int,
              start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values ``(stop - start, d)`` float64 of positions ``[start, stop)``.

    ``start`` must be a multiple of :data:`CHUNK` and ``stop - start <= CHUNK``; the draws of a
    chunk come from their own stream, so chunks can be generated in any order.
    """
    if start % CHUNK or stop - start > CHUNK:
        raise ValueError(f"chunk [{start}, {stop}) is not aligned to CHUNK = {CHUNK}")
    rng = rng_for(seed, _KEYS, sequence, layer, kv_head, start // CHUNK)
    n, d, dc = stop - start, m.head_dim, m.d_content
    pos = np.arange(start, stop)
    keys = np.zeros((n, d))
    keys[:, :dc] = rng.standard_normal((n, dc))
    heavy = rng.random(n) < HEAVY_FRACTION
    amp = rng.uniform(0.5, 1.0, n)
    values = rng.standard_normal((n, d))
    root_d = np.sqrt(d)
    keys += np.where(heavy, amp * root_d, 0.0)[:, None] * m.heavy_dir[kv_head]
    sinks = pos < N_SINKS
    keys[sinks] += root_d * m.sink_dir[kv_head]
    values[sinks] *= 0.1  # sinks carry little value, as in trained models
    keys[:, dc:dc + 2 * m.theta.size] = _rotary(pos, m.theta)
    return keys, values


def queries(m: LayerModel, seed: int, sequence: int, layer: int, head: int,
            positions: np.ndarray, *, stream: int, decode_from: int | None = None,
            keys: np.ndarray | None = None, far_limit: int | None = None) -> np.ndarray:
    """Queries ``(n, d)`` float64 of one head at ``positions``.

    Parameters
    ----------
    stream : int
        Stream id, so that different query sets of a head are independent.
    decode_from : int, optional
        Positions ``>= decode_from`` are decode queries: on a retrieval head they get the spike
        on a random far token, which needs ``keys`` (the stored keys of the head's KV head, in
        the storage dtype) and ``far_limit`` (targets lie in ``[N_SINKS, far_limit)``).
    """
    rng = rng_for(seed, _QUERIES, sequence, layer, head, stream)
    positions = np.asarray(positions, dtype=np.int64)
    n, d, dc = positions.size, m.head_dim, m.d_content
    g = head // m.group
    q = np.zeros((n, d))
    # Noise: content logits scale * q_c . n_j have standard deviation 1.
    q[:, :dc] = np.sqrt(d / dc) * rng.standard_normal((n, dc))
    root_d = np.sqrt(d)
    # Sink and heavy keys carry sqrt(d) along their direction: logit boost = b directly.
    q += (m.b_sink[head] / (m.scale * root_d)) * m.sink_dir[g]
    q += (m.b_heavy[head] / (m.scale * root_d)) * m.heavy_dir[g]
    n_freq = m.theta.size
    q[:, dc:dc + 2 * n_freq] = (m.b_local[head] / (m.scale * n_freq)) * _rotary(positions, m.theta)
    if decode_from is not None and m.retrieval[head]:
        if keys is None or far_limit is None:
            raise ValueError("retrieval queries need keys and far_limit")
        hi = max(N_SINKS + 1, int(far_limit))
        k64 = np.asarray(keys, dtype=np.float64)
        for r in np.flatnonzero(positions >= decode_from):
            t = int(positions[r])
            target = int(rng.integers(N_SINKS, min(hi, t)))
            q[r] += _spike(q[r], k64[:t + 1], target, m.scale)
    return q


def _spike(q: np.ndarray, keys: np.ndarray, target: int, scale: float) -> np.ndarray:
    """``beta * keys[target]`` such that, after adding it to ``q``, the target's logit exceeds the
    log-sum-exp of every other visible logit by :data:`RETRIEVAL_MARGIN` (Newton on ``beta``)."""
    k = keys[target]
    s0 = scale * (keys @ q)
    c = scale * (keys @ k)
    others = np.ones(keys.shape[0], dtype=bool)
    others[target] = False
    s0_o, c_o = s0[others], c[others]

    def lse(x: np.ndarray) -> float:
        top = x.max()
        return float(top + np.log(np.exp(x - top).sum()))

    beta = max(0.0, (RETRIEVAL_MARGIN + lse(s0_o) - s0[target]) / c[target])
    for _ in range(20):
        s = s0_o + beta * c_o
        w = np.exp(s - s.max())
        w /= w.sum()
        f = s0[target] + beta * c[target] - lse(s) - RETRIEVAL_MARGIN
        slope = c[target] - float(w @ c_o)
        if abs(f) < 1e-6 or slope <= 0:
            break
        beta = max(0.0, beta - f / slope)
    return beta * k
