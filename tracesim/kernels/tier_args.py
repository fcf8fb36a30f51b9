"""The argument groups of the tiers kernel (:mod:`tracesim.kernels.tiers`), one shape each.

The kernel takes five named tuples instead of forty arrays; numba compiles a named tuple of
arrays as a struct, so grouping costs nothing at run time. Shapes use ``n_kv`` KV heads,
``H = n_kv * G`` query heads, ``N`` positions, head dim ``d``, ``NQ`` evaluated decode queries,
``NP`` evicted pages, ``NS`` schedulers, ``NB`` fetch budgets and ``n_tiers`` lower tiers.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Attention", "Inclusion", "Pages", "SchedulerTable", "TierOutputs"]


class Attention(NamedTuple):
    """The attention operands of one layer (``H = n_kv * G`` query heads, ``N`` positions,
    ``NQ`` evaluated decode queries, head dim ``d``).

    Attributes
    ----------
    K, V : ndarray of float64, C-contiguous, shape (n_kv, N, d)
        Keys and values.
    Q : ndarray of float64, C-contiguous, shape (H, NQ, d)
        The evaluated decode queries (query head ``h`` reads KV head ``h // G``).
    qpos : ndarray of int64, shape (NQ,)
        Their positions ``t`` (the step sees positions ``0..t``, or its window).
    scale : float
        Softmax scale.
    softcap : float
        ``c > 0``: logits ``c * tanh(scale * q . k / c)`` (Gemma 2); 0: none.
    window : int
        ``w > 0``: a sliding layer, the step at ``t`` attends and holds ``(t - w, t]``; 0: full.
    sinks : ndarray of float64, shape (H,)
        Learned sink logits (gpt-oss), a take-all denominator term with value zero; ``-inf``
        for none.
    """

    K: np.ndarray
    V: np.ndarray
    Q: np.ndarray
    qpos: np.ndarray
    scale: float
    softcap: float = 0.0
    window: int = 0
    sinks: np.ndarray | None = None


class Inclusion(NamedTuple):
    """The base policy's kept set for one seed.

    Attributes
    ----------
    pi : ndarray of float64, shape (n_kv, N)
        Inclusion probabilities.
    kept : ndarray of bool, shape (n_kv, N)
        The kept set.
    hajek : bool
        Hájek weights ``1/pi`` on the kept tokens (else weight 1).
    certified : bool
        The certificate and its per-page share are computed.
    tail_off, tail_pos : ndarray of int64, shapes (n_kv + 1,), (n_tail,)
        Sampled kept positions (``pi < 1``) of each head, ascending:
        ``tail_pos[tail_off[g]:tail_off[g + 1]]``.
    """

    pi: np.ndarray
    kept: np.ndarray
    hajek: bool
    certified: bool
    tail_off: np.ndarray
    tail_pos: np.ndarray


class Pages(NamedTuple):
    """The evicted pages of every KV head, head by head in position order (``NP`` in all),
    summarised as :func:`tracesim.bounds.pages.build_page_summaries` does.

    Attributes
    ----------
    off : ndarray of int64, shape (n_kv + 1,)
        Page offsets per head: head ``g`` owns pages ``off[g]:off[g + 1]``.
    first : ndarray of int64, shape (NP,)
        First evicted position of each page.
    count : ndarray of int64, shape (NP,)
        Evicted tokens of each page.
    kmin, kmax : ndarray of float64, shape (NP, d)
        Coordinate-wise bounds of the page's evicted keys.
    vcen : ndarray of float64, shape (NP, d)
        Centroid of its evicted values.
    vrad : ndarray of float64, shape (NP,)
        Radius of its evicted values around the centroid.
    nbytes : ndarray of float64, shape (NP,)
        Bytes of the page (its evicted tokens' keys and values).
    tier : ndarray of int64, shape (NP,)
        The lower tier it lives in.
    block_slot : ndarray of int64, shape (n_kv, ceil(N / page))
        Index within its head of the page of each block of positions, -1 for none.
    page : int
        Positions per page.
    """

    off: np.ndarray
    first: np.ndarray
    count: np.ndarray
    kmin: np.ndarray
    kmax: np.ndarray
    vcen: np.ndarray
    vrad: np.ndarray
    nbytes: np.ndarray
    tier: np.ndarray
    block_slot: np.ndarray
    page: int


class SchedulerTable(NamedTuple):
    """The ``NS`` schedulers and ``NB`` fetch budgets of one call
    (:func:`tracesim.tiers.schedulers.kernel_schedule` builds it from names).

    Attributes
    ----------
    codes : ndarray of int64, shape (NS,)
        Scheduler codes: a built-in's ``S_*``, or ``N_BUILTIN + slot`` for a registered rule.
    fetches : ndarray of bool, shape (NS,)
        False for a scheduler that fetches nothing (``none``).
    scaled : ndarray of bool, shape (NS,)
        The step's byte budget is multiplied by ``conf_w`` (``confidence``).
    budgets : ndarray of float64, shape (NB,)
        Fetch budgets, fractions of the layer's evicted bytes.
    conf_w : ndarray of float64, shape (NQ,)
        Per-step budget multipliers of the scaled schedulers.
    rprio : ndarray of float64, shape (NQ, NP)
        Permanent uniforms of the pages (any shape without ``need_uniforms``).
    need_bound : bool
        Compute the page bound (``PageInputs.bound``).
    need_uniforms : bool
        Read ``rprio`` (``PageInputs.uniform``).
    """

    codes: np.ndarray
    fetches: np.ndarray
    scaled: np.ndarray
    budgets: np.ndarray
    conf_w: np.ndarray
    rprio: np.ndarray
    need_bound: bool
    need_uniforms: bool


class TierOutputs(NamedTuple):
    """What one call writes (``NS`` schedulers, ``NB`` budgets, ``NQ`` steps).

    Attributes
    ----------
    err_before, cert : ndarray of float64, shape (H, NQ)
        ``|o_hat - o|^2`` of the plain eviction estimate; the certificate.
    err_after : ndarray of float64, shape (NS, NB, H, NQ)
        ``|o_hat - o|^2`` after the step's fetches.
    kv_bytes, kv_pages : ndarray of float64, shape (NS, NB, n_kv, NQ)
        Bytes and pages fetched per KV head.
    evicted : ndarray of float64, shape (n_kv, NQ)
        Bytes of the KV head's evicted pages visible to the step.
    tier_nf, tier_nb : ndarray of float64, shape (NS, NB, NQ, n_tiers)
        Fetches and bytes per lower tier.
    kept_tokens : ndarray of int64, shape (NQ,)
        Kept tokens visible to the step, over all KV heads.
    order : ndarray of int64, shape (NS, NQ, NP) or (0, 0, 0)
        The visible pages in fetch order (indices into the pages), -1 after them: budget ``bi``
        fetches ``order[si, a, :nsel[si, bi, a]]``; not written when empty.
    nsel : ndarray of int64, shape (NS, NB, NQ)
        Pages fetched.
    """

    err_before: np.ndarray
    cert: np.ndarray
    err_after: np.ndarray
    kv_bytes: np.ndarray
    kv_pages: np.ndarray
    evicted: np.ndarray
    tier_nf: np.ndarray
    tier_nb: np.ndarray
    kept_tokens: np.ndarray
    order: np.ndarray
    nsel: np.ndarray


# The name before the rename, kept for one reason: numba's on-disk cache index pickles a
# compiled kernel's argument types by module and name, and unpickles the index before it checks
# whether the index is stale; a cache written before the rename must still unpickle (it is then
# found stale and recompiled) instead of failing with AttributeError. Not for new code.
Schedule = SchedulerTable
