"""Permanent random numbers: a stateless counter-based uniform per (seed, layer, kv-head, position).

Every randomized decision in tracesim draws its uniform from :func:`permanent_uniforms`, never from
a stateful generator. The same key always gives the same number, so

* kept sets are nested across budgets (token i is kept iff ``u_i < pi_i`` and pi grows with the
  budget: common random numbers),
* results do not depend on the order of work or the number of workers,
* the offline simulator and the torch in-loop path keep bit-identical token sets, and
* decode-time eviction with "kept while ``u_i < min_{tau<=t} pi_i(tau)``" stays a Poisson design.

The algorithm (version 1) uses only 32-bit unsigned arithmetic, so it can be re-implemented bit
for bit anywhere that has 64-bit integers (numpy, torch, C):

``mix32(x)``, for ``0 <= x < 2**32`` (the "lowbias32" integer finaliser)::

    x ^= x >> 16;  x = (x * 0x7FEB352D) mod 2**32
    x ^= x >> 15;  x = (x * 0x846CA68B) mod 2**32
    x ^= x >> 16

``hash(seed, stream, layer, kv_head, position)``, every argument an integer in ``[0, 2**32)``::

    h = mix32(seed     ^ 0x243F6A88)
    h = mix32(h ^ stream   ^ 0x85A308D3)
    h = mix32(h ^ layer    ^ 0x13198A2E)
    h = mix32(h ^ kv_head  ^ 0x03707344)
    h = mix32(h ^ position ^ 0xA4093822)
    g = mix32(h ^ 0x299F31D0)

``u = ((h >> 6) * 2**26 + (g >> 6) + 0.5) / 2**52`` — a float64 computed exactly (53 significant
bits), strictly inside (0, 1); the smallest value is about 1.1e-16.

With signed 64-bit integers (torch has no full uint64 arithmetic), compute the low 32 bits of
``x * c`` without overflow as
``(x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF``.

Streams separate independent uses of the same key: :data:`STREAM_INCLUSION` decides which tail
tokens are kept; other streams feed perturbations (e.g. the Gumbel noise of keyformer-like scores).
Per-step designs with fresh uniforms (schedule ``step``) decide the kept set of the decode
query at position ``t`` with stream ``STREAM_STEP + t`` = ``2**31 + t`` (:func:`step_stream`),
so each step's sample is independent of every other step's and of stream 0, and the same
``(seed, layer, kv_head, position)`` key is reused; ``t < 2**31``. Stream 2 seeds the SimHash
proxy's hyperplanes (:data:`STREAM_HASH`). A design with one sample per *query* head
(``perstep`` with ``gqa: head``) is replayed on the layer's per-query-head view, where the
``kv_head`` coordinate of its inclusion, step and bootstrap uniforms is the query head.

**Bootstrap multipliers** (:func:`bootstrap_weights`, stream :data:`STREAM_BOOTSTRAP` = 3).
The Poisson-bootstrap replicate ``r`` of the kept sample drawn with stream ``sample_stream``
(0 for the permanent uniforms, ``step_stream(t)`` for a fresh per-step sample) gives the kept
token at ``position`` of ``(seed, layer, kv_head)``, whose inclusion probability is ``pi``, a
multiplier ``N`` with mean 1 and variance ``1 - pi`` -- the variance of the Poisson design
itself, as the ``Gamma(1/(1-pi), 1-pi)`` multipliers of :func:`tracesim.certificates.
bootstrap_certificate` have, but drawn with correctly rounded float64 operations only: ``N = 1``
with probability ``pi``, otherwise ``N ~ Poisson(1)``. Both are read off one uniform of a
longer key, every argument in ``[0, 2**32)``::

    h = mix32(seed     ^ 0x243F6A88)
    h = mix32(h ^ 3            ^ 0x85A308D3)
    h = mix32(h ^ layer        ^ 0x13198A2E)
    h = mix32(h ^ kv_head      ^ 0x03707344)
    h = mix32(h ^ position     ^ 0xA4093822)
    h = mix32(h ^ replicate    ^ 0x082EFA98)
    h = mix32(h ^ sample_stream ^ 0xEC4E6C89)
    g = mix32(h ^ 0x299F31D0)

``u`` from ``(h, g)`` as above; ``N = 1`` if ``u < pi``; otherwise ``u = (u - pi) / (1 - pi)``
(uniform on ``(0, 1)`` given ``u >= pi``) and inversion of the Poisson(1) distribution function
with float64 operations only (each correctly rounded, so the result is the same everywhere)::

    p = 0.36787944117144233   (exp(-1), float64 0x3FD78B56362CEF38)
    c = p;  N = 0
    while u > c and N < 20:  N = N + 1;  p = p / N;  c = c + p

(``pi = 0`` gives plain Poisson(1) multipliers, variance 1; ``pi >= 1`` gives 1.)

(``N = 20`` caps the tail, whose probability is below 1e-19.)
"""

from __future__ import annotations

from pathlib import Path

import numba as nb
import numpy as np

from tracesim.numba_cache import versioned_cache

# before the first compiled function: the replay kernels inline these (tracesim.numba_cache)
versioned_cache(Path(__file__).resolve().parent)

__all__ = [
    "BOOTSTRAP_MAX_COUNT",
    "PRN_VERSION",
    "STREAM_BOOTSTRAP",
    "STREAM_HASH",
    "STREAM_INCLUSION",
    "STREAM_PERTURBATION",
    "STREAM_STEP",
    "bootstrap_weights",
    "permanent_uniforms",
    "step_stream",
    "uniform_grid",
]

PRN_VERSION = 1
STREAM_INCLUSION = 0
STREAM_PERTURBATION = 1
STREAM_HASH = 2
#: Stream of the Poisson-bootstrap multipliers (:func:`bootstrap_weights`).
STREAM_BOOTSTRAP = 3
STREAM_STEP = 1 << 31
#: Largest Poisson(1) multiplier :func:`bootstrap_weights` draws (the tail beyond is < 1e-19).
BOOTSTRAP_MAX_COUNT = 20


def step_stream(position: int) -> int:
    """Stream of the fresh per-step uniforms of the decode query at ``position``."""
    position = int(position)
    if not 0 <= position < STREAM_STEP:
        raise ValueError(f"step position must be in [0, 2**31), got {position}")
    return STREAM_STEP + position

_MASK32 = np.uint64(0xFFFFFFFF)
_M1 = np.uint64(0x7FEB352D)
_M2 = np.uint64(0x846CA68B)
_S16 = np.uint64(16)
_S15 = np.uint64(15)
_S6 = np.uint64(6)
_K_SEED = np.uint64(0x243F6A88)
_K_STREAM = np.uint64(0x85A308D3)
_K_LAYER = np.uint64(0x13198A2E)
_K_HEAD = np.uint64(0x03707344)
_K_POS = np.uint64(0xA4093822)
_K_FINAL = np.uint64(0x299F31D0)
_K_REPLICATE = np.uint64(0x082EFA98)
_K_SAMPLE = np.uint64(0xEC4E6C89)
_S_BOOTSTRAP = np.uint64(STREAM_BOOTSTRAP)
_EXP_MINUS_ONE = 0.36787944117144233
_TWO26 = 67108864.0
_TWO52 = 4503599627370496.0


@nb.njit(cache=True, inline="always")
def _mix32(x: np.uint64) -> np.uint64:
    # All constants are uint64 so numba never promotes to float (uint64 op int64 -> float64).
    x ^= x >> _S16
    x = (x * _M1) & _MASK32
    x ^= x >> _S15
    x = (x * _M2) & _MASK32
    x ^= x >> _S16
    return x


@nb.njit(cache=True, inline="always")
def key_prefix(seed: np.uint64, stream: np.uint64, layer: np.uint64,
               kv_head: np.uint64) -> np.uint64:
    """The hash state after ``(seed, stream, layer, kv_head)``: shared by every position of
    one key, so a caller drawing many positions computes it once (:func:`uniform_at`)."""
    h = _mix32(seed ^ _K_SEED)
    h = _mix32(h ^ stream ^ _K_STREAM)
    h = _mix32(h ^ layer ^ _K_LAYER)
    return _mix32(h ^ kv_head ^ _K_HEAD)


@nb.njit(cache=True, inline="always")
def uniform_at(prefix: np.uint64, position: np.uint64) -> float:
    """The uniform of ``position`` from its key's :func:`key_prefix` (the same integer
    operations as :func:`_uniform`, so the same float64)."""
    h = _mix32(prefix ^ position ^ _K_POS)
    g = _mix32(h ^ _K_FINAL)
    hi = float(h >> _S6)
    lo = float(g >> _S6)
    return (hi * _TWO26 + lo + 0.5) / _TWO52


@nb.njit(cache=True)
def _uniform(seed: np.uint64, stream: np.uint64, layer: np.uint64, kv_head: np.uint64,
             position: np.uint64) -> float:
    return uniform_at(key_prefix(seed, stream, layer, kv_head), position)


@nb.njit(cache=True)
def bootstrap_count(seed, layer, kv_head, position, replicate, sample_stream, pi):
    """Multiplier of one kept token with inclusion probability ``pi`` in one bootstrap
    replicate: 1 with probability ``pi``, else Poisson(1) (mean 1, variance ``1 - pi``; module
    docstring).

    Every argument but ``pi`` (float64) is an integer in ``[0, 2**32)``; returns a float64
    integer in ``[0, 20]``. For compiled callers (the replay's bootstrap kernel)."""
    h = _mix32(np.uint64(seed) ^ _K_SEED)
    h = _mix32(h ^ _S_BOOTSTRAP ^ _K_STREAM)
    h = _mix32(h ^ np.uint64(layer) ^ _K_LAYER)
    h = _mix32(h ^ np.uint64(kv_head) ^ _K_HEAD)
    h = _mix32(h ^ np.uint64(position) ^ _K_POS)
    h = _mix32(h ^ np.uint64(replicate) ^ _K_REPLICATE)
    h = _mix32(h ^ np.uint64(sample_stream) ^ _K_SAMPLE)
    g = _mix32(h ^ _K_FINAL)
    u = (float(h >> _S6) * _TWO26 + float(g >> _S6) + 0.5) / _TWO52
    if u < pi:
        return 1.0
    u = (u - pi) / (1.0 - pi)
    p = _EXP_MINUS_ONE
    c = p
    n = 0
    while u > c and n < BOOTSTRAP_MAX_COUNT:
        n += 1
        p = p / n
        c = c + p
    return float(n)


@nb.njit(cache=True)
def _bootstrap_weights_kernel(seed, layer, kv_head, positions, sample_stream, pi, out):
    for r in range(out.shape[0]):
        for i in range(positions.size):
            out[r, i] = bootstrap_count(seed, layer, kv_head, positions[i], r, sample_stream,
                                        pi[i])


def bootstrap_weights(seed: int, layer: int, kv_head: int, positions: np.ndarray,
                      n_replicates: int, *, pi: np.ndarray | None = None,
                      sample_stream: int = STREAM_INCLUSION) -> np.ndarray:
    """Poisson-bootstrap multipliers of kept tokens, from the permanent random numbers.

    Parameters
    ----------
    seed, layer, kv_head : int
        Key components, each in ``[0, 2**32)``.
    positions : array_like of int, shape (n,)
        Token positions, each in ``[0, 2**32)``.
    n_replicates : int
        Replicates ``r = 0 .. n_replicates - 1``.
    pi : array_like of float, shape (n,), optional
        The tokens' inclusion probabilities; a multiplier is 1 with probability ``pi`` and
        Poisson(1) otherwise. Default 0: plain Poisson(1) multipliers.
    sample_stream : int, default 0
        Stream of the kept sample being resampled: 0 for the permanent uniforms,
        :func:`step_stream` ``(t)`` for the fresh per-step sample of the query at ``t``.

    Returns
    -------
    numpy.ndarray of float64, shape (n_replicates, n)
        Integer-valued multipliers in ``[0, BOOTSTRAP_MAX_COUNT]``, mean 1 and variance
        ``1 - pi``;
        identical on every platform and for every call order (see the module docstring).
    """
    pos = np.atleast_1d(np.asarray(positions)).astype(np.int64)
    if pos.size and (pos.min() < 0 or pos.max() >= 2**32):
        raise ValueError("positions must lie in [0, 2**32)")
    n_rep = int(n_replicates)
    if n_rep < 0:
        raise ValueError(f"n_replicates = {n_replicates}: expected >= 0")
    probs = (np.zeros(pos.size) if pi is None
             else np.broadcast_to(np.asarray(pi, dtype=np.float64), pos.shape).copy())
    out = np.empty((n_rep, pos.size))
    _bootstrap_weights_kernel(int(_as_u32(seed, "seed")), int(_as_u32(layer, "layer")),
                              int(_as_u32(kv_head, "kv_head")), pos,
                              int(_as_u32(sample_stream, "sample_stream")), probs, out)
    return out


@nb.njit(cache=True)
def step_uniforms_into(seed, stream, layer, kv_head, end, out):
    """Uniforms of ``stream`` for positions ``[0, end)`` into ``out[:end]``; ``out[end:]`` = 0
    (every later position is kept whatever its ``pi``). For compiled callers (the replay
    kernel draws each fresh per-step sample here instead of storing one table per step)."""
    prefix = key_prefix(np.uint64(seed), np.uint64(stream), np.uint64(layer),
                        np.uint64(kv_head))
    for p in range(end):
        out[p] = uniform_at(prefix, np.uint64(p))
    for p in range(end, out.size):
        out[p] = 0.0


@nb.njit(cache=True)
def _uniforms_kernel(seed: np.uint64, stream: np.uint64, layer: np.uint64, kv_head: np.uint64,
                     positions: np.ndarray, out: np.ndarray) -> None:
    for i in range(positions.size):
        out[i] = _uniform(seed, stream, layer, kv_head, np.uint64(positions[i]))


@nb.njit(cache=True)
def _uniform_grid_job(job: int, seeds: np.ndarray, stream: np.uint64, layer: np.uint64,
                      out: np.ndarray) -> None:
    n_kv = out.shape[1]
    i = job // n_kv
    g = job % n_kv
    prefix = key_prefix(np.uint64(seeds[i]), stream, layer, np.uint64(g))
    for p in range(out.shape[2]):
        out[i, g, p] = uniform_at(prefix, np.uint64(p))


@nb.njit(cache=True, parallel=True)
def _uniform_grid_par(seeds, stream, layer, out) -> None:
    for job in nb.prange(out.shape[0] * out.shape[1]):
        _uniform_grid_job(job, seeds, stream, layer, out)


@nb.njit(cache=True)
def _uniform_grid_ser(seeds, stream, layer, out) -> None:
    for job in range(out.shape[0] * out.shape[1]):
        _uniform_grid_job(job, seeds, stream, layer, out)


def uniform_grid(seeds: np.ndarray, layer: int, n_kv_heads: int, n_positions: int, *,
                 stream: int = STREAM_INCLUSION) -> np.ndarray:
    """:func:`permanent_uniforms` of every seed, KV head and position ``0..P-1`` in one call.

    Returns
    -------
    numpy.ndarray of float64, shape (n_seeds, n_kv_heads, n_positions)
    """
    seeds = np.asarray(seeds, dtype=np.int64).reshape(-1)
    for s in seeds:
        _as_u32(s, "seed")
    _as_u32(n_kv_heads - 1 if n_kv_heads else 0, "kv_head")
    _as_u32(max(n_positions - 1, 0), "position")
    out = np.empty((seeds.size, int(n_kv_heads), int(n_positions)))
    # A parallel region only pays off for large grids (about 10 ns per uniform serially).
    kernel = _uniform_grid_ser if out.size < (1 << 20) else _uniform_grid_par
    kernel(seeds, _as_u32(stream, "stream"), _as_u32(layer, "layer"), out)
    return out


def _as_u32(value: int, name: str) -> np.uint64:
    value = int(value)
    if not 0 <= value < 2**32:
        raise ValueError(f"{name} must be an integer in [0, 2**32), got {value}")
    return np.uint64(value)


def permanent_uniforms(
    seed: int,
    layer: int,
    kv_head: int,
    positions: np.ndarray | int,
    *,
    stream: int = STREAM_INCLUSION,
) -> np.ndarray:
    """Permanent uniform random numbers ``u(seed, layer, kv_head, position)`` in (0, 1).

    Parameters
    ----------
    seed, layer, kv_head : int
        Key components, each in ``[0, 2**32)``.
    positions : array_like of int, shape (n,)
        Token positions (absolute positions in the sequence), each in ``[0, 2**32)``.
    stream : int, default 0
        Independent use of the same key (0: inclusion decisions, 1: perturbations).

    Returns
    -------
    numpy.ndarray of float64, shape (n,)
        One uniform per position; identical on every platform and for every call order.

    Examples
    --------
    >>> u = permanent_uniforms(0, 3, 1, np.arange(5))
    >>> bool(((u > 0) & (u < 1)).all())
    True
    """
    pos = np.asarray(positions)
    scalar = pos.ndim == 0
    pos = np.atleast_1d(pos)
    if pos.ndim != 1:
        raise ValueError(f"positions must be one-dimensional, got shape {pos.shape}")
    if pos.size and not np.issubdtype(pos.dtype, np.integer):
        raise ValueError(f"positions must be integers, got dtype {pos.dtype}")
    if pos.size and (pos.min() < 0 or pos.max() >= 2**32):
        raise ValueError("positions must lie in [0, 2**32)")
    out = np.empty(pos.size, dtype=np.float64)
    _uniforms_kernel(
        _as_u32(seed, "seed"), _as_u32(stream, "stream"), _as_u32(layer, "layer"),
        _as_u32(kv_head, "kv_head"), pos.astype(np.int64), out,
    )
    return out[0] if scalar else out
