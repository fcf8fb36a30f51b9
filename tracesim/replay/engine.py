"""Replay one layer: shared logits and truth, inclusion tables, then the compiled kernel.

Memory is bounded by one layer of one sequence (its K/V in float64, the evaluated queries'
``exp``-logits ``(n_heads, n_query, P)`` and the per-iteration results), however many layers
and sequences the store holds. A layer, not a single head, is the unit because the GQA /
output-space certificate and Ada-KV's allocation both couple the heads of a layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.linalg.cython_blas  # noqa: F401  (loaded before the thread limit is applied)
from scipy import stats
from threadpoolctl import threadpool_limits

from tracesim.kernels.bounds import N_BOUND_FIELDS, bound_kernel
from tracesim.kernels.replay import N_FIELDS, N_LAYER_FIELDS, replay_kernel
from tracesim.kernels.replay_events import (
    N_STATS,
    TOP_ELIGIBLE,
    event_stats_kernel,
    exp_logits_kernel,
    truth_kernel,
)
from tracesim.policies import LayerTrace, Policy
from tracesim.replay.inclusion import InclusionTables, build_inclusion, seed_uniforms

__all__ = ["OUTPUT_CHECK_TOLERANCE", "LayerResult", "ReplayOptions", "evaluated_queries",
           "replay_layer"]

#: Largest accepted ``max |o_stored - o_recomputed| / |o|`` before a warning (fp16 stores
#: measure ~2e-4 median and ~5e-3 worst on the SmolLM2 sample traces).
OUTPUT_CHECK_TOLERANCE = 0.02


@dataclass(frozen=True)
class ReplayOptions:
    """Engine options.

    Parameters
    ----------
    alpha : float, default 0.05
        Two-sided level of the coverage events.
    output_space : bool, default True
        Compute the per-layer output-space (GQA) certificate and error when ``o_proj`` is stored.
    satterthwaite : bool, default False
        Also compute ``tr(V_hat^2)`` for the vector-level Satterthwaite event. It costs
        ``O(m d^2)`` per query, head and seed against ``O(m d)`` for everything else (a factor
        ~``d/4`` = 16 at d = 64), so it is off for sweeps; use it on small per-seed runs.
    roles : tuple of str, optional
        Query roles to evaluate. Default: ``decode`` queries, or ``question_window`` ones when
        the sequence stores no decode query.
    """

    alpha: float = 0.05
    output_space: bool = True
    satterthwaite: bool = False
    roles: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not 0.0 < float(self.alpha) < 1.0:
            raise ValueError(f"ReplayOptions.alpha = {self.alpha}: expected (0, 1)")


def evaluated_queries(trace: LayerTrace, roles: tuple[str, ...] | None = None) -> np.ndarray:
    """Indices (into the stored queries) of the queries the replay evaluates."""
    wanted = roles or ("decode",)
    idx = np.array([i for i, r in enumerate(trace.query_roles) if r in wanted], dtype=np.int64)
    if idx.size == 0 and roles is None:
        idx = trace.role_indices("question_window")
    if idx.size == 0:
        raise ValueError(f"sequence {trace.sequence_id!r} stores no query with role "
                         f"{wanted if roles else ('decode', 'question_window')}")
    return idx


@dataclass
class LayerResult:
    """Raw results of one layer (see :mod:`tracesim.kernels.replay` for the field indices).

    Attributes
    ----------
    out : ndarray, shape (n_iter, n_heads, n_query, N_FIELDS)
    lout : ndarray, shape (n_iter, n_query, N_LAYER_FIELDS)
    tables : InclusionTables
    query_index, query_positions : ndarray of int64, shape (n_query,)
    query_roles : list of str
    output_check : ndarray, shape (n_heads, n_query)
        Max |stored output - float64 recomputation| per head and query (NaN if not stored).
    truth_norm : ndarray, shape (n_heads, n_query)
        ``|o|`` of the full-cache output.
    seeds : ndarray of int64
    bounds : ndarray, shape (n_iter, n_heads, n_query, N_BOUND_FIELDS), or None
        Page-summary bound, missing-mass bound and summary memory
        (:mod:`tracesim.kernels.bounds`); NaN for policies without summaries, None if no
        policy has any.
    """

    trace: LayerTrace
    policies: list[Policy]
    out: np.ndarray
    lout: np.ndarray
    tables: InclusionTables
    query_index: np.ndarray
    query_positions: np.ndarray
    query_roles: list[str]
    output_check: np.ndarray
    truth_norm: np.ndarray
    seeds: np.ndarray
    options: ReplayOptions
    bounds: np.ndarray | None = None

    @property
    def output_check_relative(self) -> float:
        """Worst ``max_j |o_stored - o| / |o|`` of the layer (NaN without stored outputs)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = self.output_check / np.maximum(self.truth_norm, 1e-30)
        return float(np.max(rel)) if np.isfinite(rel).any() else float("nan")


def exp_logits(trace: LayerTrace, qidx: np.ndarray) -> np.ndarray:
    """``exp(s - max s)`` per (head, evaluated query, position) with causal zeros, float64."""
    E = np.empty((trace.n_heads, qidx.size, trace.n_positions))
    exp_logits_kernel(np.ascontiguousarray(trace.queries[:, qidx]),
                      np.ascontiguousarray(trace.keys), np.ascontiguousarray(
                          trace.query_positions[qidx], dtype=np.int64),
                      float(trace.scale), trace.group_size, E)
    return E


def _output_space(trace: LayerTrace, enabled: bool):
    """Gram blocks, per-token quadratic forms and ``W^T`` for the output-space certificate."""
    n_kv, P, d = trace.keys.shape
    G = trace.group_size
    pidx = np.zeros((G, G), dtype=np.int64)
    pairs = [(a, a) for a in range(G)] + [(a, b) for a in range(G) for b in range(a + 1, G)]
    for i, (a, b) in enumerate(pairs):
        pidx[a, b] = pidx[b, a] = i
    if not enabled or trace.o_proj is None:
        return (np.zeros((n_kv, len(pairs), 1, 1)), np.zeros((n_kv, len(pairs), 1)), pidx,
                np.zeros((0, 1)))
    W = np.asarray(trace.o_proj, dtype=np.float64)
    if W.shape[1] != trace.n_heads * d:
        raise ValueError(f"o_proj has {W.shape[1]} columns, expected {trace.n_heads * d}")
    gam = np.empty((n_kv, len(pairs), d, d))
    vq = np.empty((n_kv, len(pairs), P))
    for g in range(n_kv):
        for i, (a, b) in enumerate(pairs):
            Wa = W[:, (g * G + a) * d:(g * G + a + 1) * d]
            Wb = W[:, (g * G + b) * d:(g * G + b + 1) * d]
            gam[g, i] = Wa.T @ Wb
            vq[g, i] = np.einsum("pk,kl,pl->p", trace.values[g], gam[g, i], trace.values[g])
    return gam, vq, pidx, np.ascontiguousarray(W.T)


def replay_layer(trace: LayerTrace, policies: list[Policy], seeds: np.ndarray,
                 n_layers: int, options: ReplayOptions | None = None) -> LayerResult:
    """Replay every policy and seed on one layer of one sequence.

    Parameters
    ----------
    trace : LayerTrace
    policies : list of Policy
    seeds : ndarray of int, shape (S,)
        Seeds of the permanent random numbers; deterministic policies use only the first.
    n_layers : int
        Number of layers of the model (PyramidKV schedule).
    options : ReplayOptions, optional

    Returns
    -------
    LayerResult
    """
    options = options or ReplayOptions()
    seeds = np.asarray(seeds, dtype=np.int64)
    if seeds.ndim != 1 or seeds.size == 0:
        raise ValueError("seeds must be a non-empty 1-D array of ints")
    if not policies:
        raise ValueError("no policies to replay")
    qidx = evaluated_queries(trace, options.roles)
    qpos = np.ascontiguousarray(trace.query_positions[qidx], dtype=np.int64)
    H, NQ, P = trace.n_heads, qidx.size, trace.n_positions
    d = trace.keys.shape[2]
    u = seed_uniforms(seeds, trace.layer, trace.n_kv_heads, P)
    tables = build_inclusion(trace, policies, seeds, qpos, u, n_layers)
    E = exp_logits(trace, qidx)
    V = np.ascontiguousarray(trace.values, dtype=np.float64)
    gam, vq, pidx, wo_t = _output_space(trace, options.output_space)
    flags = np.array([[p.correction == "hajek", p.certified,
                       p.design is not None and p.design.variance == "fixed"]
                      for p in policies], dtype=np.int64)
    m = np.arange(P + 2, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        t_table = np.where(m > 1, stats.t.ppf(1 - options.alpha / 2, np.maximum(m - 1, 1)),
                           np.inf)
    z = float(stats.norm.ppf(1 - options.alpha / 2))
    kmask = tables.kmask if tables.kmask.shape[0] else np.zeros((1, trace.n_kv_heads, P),
                                                                 np.uint8)
    truth = np.empty((H, NQ, d))
    zfull = np.empty((H, NQ))
    n_it = tables.it_cfg.size
    out = np.empty((n_it, H, NQ, N_FIELDS))
    lout = np.empty((n_it, NQ, N_LAYER_FIELDS))
    # One BLAS thread per numba iteration: no oversubscription, and bit-identical results for
    # any numba thread count (multi-threaded BLAS inside the loop changes the last bits).
    with threadpool_limits(limits=1, user_api="blas"):
        truth_kernel(E, V, np.arange(NQ, dtype=np.int64), truth, zfull)
        ev_stats = np.empty((tables.ev_q.size, H, N_STATS))
        top = np.empty((tables.ev_q.size, H, TOP_ELIGIBLE), dtype=np.int64)
        event_stats_kernel(E, zfull, tables.pi, tables.ev_qptr, tables.ev_q, qpos,
                           trace.group_size, ev_stats, top)
        replay_kernel(E, zfull, V, V * V, (V * V).sum(axis=2), truth, qpos, tables.pi,
                      tables.tau, tables.ev_qptr, tables.ev_q, tables.slot_ev, kmask, u,
                      tables.it_cfg, tables.it_seed, tables.it_slot, tables.it_kslot, flags,
                      z, t_table, gam, np.ascontiguousarray(gam.transpose(0, 1, 3, 2)), vq, pidx,
                      wo_t, bool(options.satterthwaite), ev_stats, top,
                      out, lout)
    bounds = _bound_pass(trace, policies, qidx, qpos, tables, kmask, u)
    check = np.full((H, NQ), np.nan)
    if trace.outputs is not None:
        check = np.abs(trace.outputs[:, qidx] - truth).max(axis=2)
    return LayerResult(trace=trace, policies=list(policies), out=out, lout=lout, tables=tables,
                       query_index=qidx, query_positions=qpos,
                       query_roles=[trace.query_roles[i] for i in qidx], output_check=check,
                       truth_norm=np.linalg.norm(truth, axis=2), seeds=seeds, options=options,
                       bounds=bounds)


def _bound_pass(trace: LayerTrace, policies: list[Policy], qidx: np.ndarray, qpos: np.ndarray,
                tables: InclusionTables, kmask: np.ndarray, u: np.ndarray) -> np.ndarray | None:
    """The page-summary bound of every iteration (``None`` if no policy keeps summaries)."""
    page = np.array([p.summary_page for p in policies], dtype=np.int64)
    if not (page > 0).any():
        return None
    corrected = np.array([p.correction == "hajek" for p in policies], dtype=np.bool_)
    out = np.empty((tables.it_cfg.size, trace.n_heads, qidx.size, N_BOUND_FIELDS))
    bound_kernel(np.ascontiguousarray(trace.queries[:, qidx], dtype=np.float64),
                 np.ascontiguousarray(trace.keys, dtype=np.float64),
                 np.ascontiguousarray(trace.values, dtype=np.float64), qpos, float(trace.scale),
                 tables.pi, tables.ev_qptr, tables.ev_q, tables.slot_ev, kmask, u,
                 tables.it_cfg, tables.it_seed, tables.it_slot, tables.it_kslot, corrected, page,
                 out)
    return out
