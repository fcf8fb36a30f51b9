"""The argument groups of the page-summary bound pass (:mod:`tracesim.kernels.bounds`).

:func:`~tracesim.kernels.bounds.bound_kernel` takes three groups instead of seventeen loose
arrays and :func:`~tracesim.kernels.bounds.row_bound` four instead of twenty-three; numba
compiles a named tuple of arrays as a struct of array views, so grouping costs nothing at run
time and every operation is the one it was with loose arguments. Shapes use ``H = n_kv * G``
query heads, ``NQ`` evaluated queries, ``P`` positions, head dimension ``d``, ``n_events``
events of every slot together, ``n_iter`` (policy, seed) iterations, ``n_cfg`` policies, ``S``
seeds and ``n_pages`` (at most ``ceil(P / page)``) pages of missing tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["BoundIterations", "BoundLayer", "BoundScratch", "KeptHead", "MissingPages"]


class BoundLayer(NamedTuple):
    """The layer's attention operands and the events of the inclusion tables.

    Attributes
    ----------
    Q : ndarray of float64, C-contiguous, shape (H, NQ, d)
        Evaluated queries (query head ``h`` reads KV head ``h // G``).
    K, V : ndarray of float64, C-contiguous, shape (n_kv, P, d)
        Keys and values.
    qpos : ndarray of int64, shape (NQ,)
        Query positions (query ``q`` sees positions ``0..qpos[q]``).
    scale : float
        Softmax scale.
    pi : ndarray of float64, shape (n_events, n_kv, P)
        Inclusion probabilities of each event.
    ev_qptr, ev_q : ndarray of int64
        The queries of event ``e`` are ``ev_q[ev_qptr[e]:ev_qptr[e + 1]]``.
    slot_ev : ndarray of int64, shape (n_slots + 1,)
        The events of slot ``s`` are ``slot_ev[s]:slot_ev[s + 1]``.
    kmask : ndarray, shape (>= 1, n_kv, P)
        Kept masks of fixed-size designs (non-zero: kept), by kept-mask slot.
    u : ndarray of float64, shape (S, n_kv, P)
        Permanent uniforms: position ``p`` is kept when ``u < pi`` (other designs).
    """

    Q: np.ndarray
    K: np.ndarray
    V: np.ndarray
    qpos: np.ndarray
    scale: float
    pi: np.ndarray
    ev_qptr: np.ndarray
    ev_q: np.ndarray
    slot_ev: np.ndarray
    kmask: np.ndarray
    u: np.ndarray


class BoundIterations(NamedTuple):
    """The (policy, seed) iterations and the per-policy settings the bound reads.

    Attributes
    ----------
    it_cfg, it_seed, it_slot, it_kslot : ndarray of int64, shape (n_iter,)
        Each iteration's policy, seed, slot and kept-mask slot (``-1``: draw ``u < pi``).
    corrected : ndarray of bool, shape (n_cfg,)
        Hájek offsets ``-log pi`` on the kept tokens (else none).
    page : ndarray of int64, shape (n_cfg,)
        Positions per summary page; ``0`` for a policy without summaries (its rows are NaN).
    """

    it_cfg: np.ndarray
    it_seed: np.ndarray
    it_slot: np.ndarray
    it_kslot: np.ndarray
    corrected: np.ndarray
    page: np.ndarray


class KeptHead(NamedTuple):
    """One KV head's cache and kept set at one event (built inside the kernel).

    Attributes
    ----------
    K, V : ndarray of float64, shape (P, d)
        The head's keys and values.
    scale : float
        Softmax scale.
    kept_idx : ndarray of int64, shape (P,)
        The first ``m`` entries are the kept positions, ascending.
    m : int
        Kept tokens.
    pi_row : ndarray of float64, shape (P,)
        The event's inclusion probabilities for the head.
    corrected : bool
        Hájek offsets on the kept tokens with ``pi < 1``.
    """

    K: np.ndarray
    V: np.ndarray
    scale: float
    kept_idx: np.ndarray
    m: int
    pi_row: np.ndarray
    corrected: bool


class MissingPages(NamedTuple):
    """Summaries of the missing (not kept) positions in pages, ascending; the first ``n``
    entries of each array are filled (:func:`~tracesim.kernels.bounds.build_pages`).

    Attributes
    ----------
    n : int
        Non-empty pages.
    kmin, kmax : ndarray of float64, shape (>= n, d)
        Coordinate-wise bounds of the page's missing keys.
    vcen : ndarray of float64, shape (>= n, d)
        Centroid of its missing values.
    vrad : ndarray of float64, shape (>= n,)
        Radius of its missing values around the centroid.
    count : ndarray of float64, shape (>= n,)
        Missing tokens of the page.
    first, last : ndarray of int64, shape (>= n,)
        Its first and last missing position.
    """

    n: int
    kmin: np.ndarray
    kmax: np.ndarray
    vcen: np.ndarray
    vrad: np.ndarray
    count: np.ndarray
    first: np.ndarray
    last: np.ndarray


class BoundScratch(NamedTuple):
    """Work arrays of :func:`~tracesim.kernels.bounds.row_bound`, allocated once per
    iteration (their values on entry are never read).

    Attributes
    ----------
    s : ndarray of float64, shape (P,)
        Logits of the kept tokens.
    o_r, o_h : ndarray of float64, shape (d,)
        The kept tokens' softmax average and the policy's estimate.
    hi, lo : ndarray of float64, shape (n_pages,)
        Upper and lower logit bounds of each page (``hi`` then the box widths).
    dist : ndarray of float64, shape (n_pages,)
        Distance bound of each page's values from the estimate.
    """

    s: np.ndarray
    o_r: np.ndarray
    o_h: np.ndarray
    hi: np.ndarray
    lo: np.ndarray
    dist: np.ndarray
