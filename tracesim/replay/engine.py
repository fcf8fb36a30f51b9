"""Replay one layer: shared logits and truth, inclusion tables, then the compiled kernel.

Memory is bounded by one layer of one sequence (its K/V in float64, the permanent uniforms
``(seeds, n_kv, P)``, a block of ``exp``-logits ``(n_heads, query chunk, P)`` of at most
:data:`LOGIT_BUDGET_BYTES` and the per-iteration results), however many layers and sequences
the store holds and however long the context. A layer, not a single head, is the unit because
the GQA / output-space certificate and Ada-KV's allocation both couple the heads of a layer.

A *sample layout* says which heads share a kept set: one sample per KV head, shared by its
group's query heads (every score but one), or one per query head (``perstep`` with
``gqa: head``). Policies of the second layout are replayed on the layer's per-query-head view
(:meth:`tracesim.policies.LayerTrace.per_query_head`: each query head with its own copy of its
KV head's keys and values), where every kernel, certificate and output-space term is the one
of a multi-head layer; :func:`replay_layer_runs` splits a list that mixes the two.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import scipy.linalg.cython_blas  # noqa: F401  (loaded before the thread limit is applied)
from scipy import special  # t and normal quantiles (scipy.stats is slow to import)
from threadpoolctl import ThreadpoolController

from tracesim.counts import BOOTSTRAP_REPLICATES
from tracesim.heap import keep_freed_memory
from tracesim.kernels.bound_args import BoundIterations, BoundLayer
from tracesim.kernels.bounds import N_BOUND_FIELDS, bound_kernel
from tracesim.kernels.replay import F_WALD, N_FIELDS, N_LAYER_FIELDS, replay_kernel
from tracesim.kernels.replay_bootstrap import B_COV, N_BOOT_FIELDS, bootstrap_kernel
from tracesim.kernels.replay_events import (
    check_exp_range,
    event_parts,
    exp_logits_kernel,
    truth_kernel,
)
from tracesim.kernels.replay_operands import (
    CertificateConstants,
    ChunkTensors,
    InclusionArrays,
    IterationTables,
    OutputSpace,
    ReplayOutputs,
)
from tracesim.layer_trace import LayerTrace
from tracesim.policies import Policy
from tracesim.replay.inclusion import InclusionTables, build_inclusion, seed_uniforms
from tracesim.replay.output_space import (  # noqa: F401  (GramBlocks & co. were defined here)
    LAYER_ERROR_BLOCK,
    GramBlocks,
    _pairs,
    gram_blocks,
    token_quadratic_forms,
)
from tracesim.replay.variants import variant_exp_logits

__all__ = ["LAYER_ERROR_BLOCK", "LOGIT_BUDGET_BYTES", "MAX_BOOTSTRAP", "OUTPUT_CHECK_TOLERANCE",
           "PRECISIONS",
           "GramBlocks", "LayerResult", "ReplayOptions", "ReplaySetup", "evaluated_queries",
           "gram_blocks", "layout_runs", "query_chunk", "replay_layer", "replay_layer_runs",
           "t_table", "token_quadratic_forms"]

#: Largest accepted ``max |o_stored - o_recomputed| / |o|`` before a warning (fp16 stores
#: measure ~2e-4 median and ~5e-3 worst on the SmolLM2 sample traces).
OUTPUT_CHECK_TOLERANCE = 0.02
#: Largest float64 logit block ``(n_heads, queries, P)`` held at once; longer contexts are
#: replayed in passes over chunks of the evaluated queries (64 MiB: all queries up to
#: P ~ 29k at 9 heads x 32 queries).
LOGIT_BUDGET_BYTES = 64 << 20
#: Accepted ``ReplayOptions.precision`` values (float64 is the reference).
PRECISIONS = ("float64", "float32")
#: Largest accepted ``ReplayOptions.bootstrap`` (replicates per row).
MAX_BOOTSTRAP = BOOTSTRAP_REPLICATES.hi


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
    precision : {"float64", "float32"}, default "float64"
        Storage of the logits, kept values and Hájek weight matrices, and so of the value
        GEMMs (DGEMM or SGEMM), including the layer error's ``W_O (o_hat - o)``. Row sums,
        normalisers, certificates' scalar terms, the Gram products and every sum of squares
        stay float64. ``float64`` is the
        reference mode (agreement with the plain-numpy replay to 1e-10); ``float32`` agrees
        to the tolerance documented in ``docs/replay.md`` and halves the logit memory.
    bootstrap : int, default 0
        Poisson-bootstrap replicates B per certified row (columns ``boot_cov``,
        ``boot_cert2``); 0 = off (no bootstrap work, and the columns are absent), else
        ``2 <= B <=`` :data:`MAX_BOOTSTRAP`. Costs about B times the estimate per row.
    """

    alpha: float = 0.05
    output_space: bool = True
    satterthwaite: bool = False
    roles: tuple[str, ...] | None = None
    precision: str = "float64"
    bootstrap: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < float(self.alpha) < 1.0:
            raise ValueError(f"ReplayOptions.alpha = {self.alpha}: expected (0, 1)")
        if self.precision not in PRECISIONS:
            raise ValueError(f"ReplayOptions.precision = {self.precision!r}: expected one of "
                             f"{PRECISIONS}")
        b = self.bootstrap
        if (isinstance(b, bool) or not isinstance(b, (int, np.integer))
                or not (b == 0 or 2 <= b <= MAX_BOOTSTRAP)):
            raise ValueError(f"ReplayOptions.bootstrap = {b!r}: expected 0 (off) or an integer "
                             f"in [2, {MAX_BOOTSTRAP}]")


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
    boot : ndarray, shape (n_iter, n_heads, n_query, N_BOOT_FIELDS), or None
        Poisson-bootstrap coverage and variance (:mod:`tracesim.kernels.replay_bootstrap`);
        None when ``options.bootstrap`` is 0.
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
    boot: np.ndarray | None = None

    @property
    def output_check_relative(self) -> float:
        """Worst ``max_j |o_stored - o| / |o|`` of the layer (NaN without stored outputs)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = self.output_check / np.maximum(self.truth_norm, 1e-30)
        return float(np.max(rel)) if np.isfinite(rel).any() else float("nan")


@functools.lru_cache(maxsize=16)
def _t_quantiles(alpha: float, n: int) -> np.ndarray:
    m = np.arange(n, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        out = np.where(m > 1, special.stdtrit(np.maximum(m - 1, 1), 1 - alpha / 2), np.inf)
    out.flags.writeable = False
    return out


def t_table(alpha: float, P: int) -> np.ndarray:
    """Two-sided Student quantiles ``t_{m-1}(1 - alpha/2)`` for tail sizes ``m = 0..P+1``
    (inf for ``m <= 1``). Cached: computed once per replay, not per layer."""
    n = 1 << max(int(P + 2 - 1).bit_length(), 6)
    return _t_quantiles(float(alpha), n)[:P + 2]


_CONTROLLER: list[ThreadpoolController] = []


def blas_single_thread():
    """Context manager limiting BLAS to one thread (the controller is built once per process:
    discovering the loaded libraries is the expensive part)."""
    if not _CONTROLLER:
        _CONTROLLER.append(ThreadpoolController())
    return _CONTROLLER[0].limit(limits=1, user_api="blas")


class ReplaySetup:
    """What every layer of one replay shares: options, Student quantiles and the per-layer
    output-space Gram blocks (``o_proj`` is a property of the store, not of a sequence).

    Build one per replay over one store (:func:`tracesim.replay.iter_replay` does) and pass it
    to :func:`replay_layer`. The first one in a process keeps freed memory for reuse
    (:func:`tracesim.heap.keep_freed_memory`: each layer's arrays would otherwise come back as
    fresh pages, a page fault per 4 KiB).

    Parameters
    ----------
    options : ReplayOptions, optional
    gram_cache : dict, optional
        Where the Gram blocks are kept; pass one dict per store to share them between the
        replays of that store (:func:`tracesim.replay.iter_replay` passes the store's
        ``gram_cache``: the QR factor of ``o_proj`` costs more than the layer errors of one
        configuration at 32 seeds). Default: a dict of this set-up only.
    """

    def __init__(self, options: ReplayOptions | None = None,
                 gram_cache: dict | None = None) -> None:
        keep_freed_memory()
        self.options = options or ReplayOptions()
        self.z = float(special.ndtri(1 - self.options.alpha / 2))
        self._gram: dict[tuple[int, int, int], GramBlocks] = (
            {} if gram_cache is None else gram_cache)

    def gram(self, trace: LayerTrace) -> GramBlocks | None:
        """Gram blocks of ``trace``'s layer (None when off or without ``o_proj``), cached."""
        if not self.options.output_space or trace.o_proj is None:
            return None
        # A per-query-head view has other groups (n_kv = n_heads, G = 1) for the same o_proj.
        key = (trace.layer, trace.o_proj.shape[0], trace.n_kv_heads)
        if key not in self._gram:
            self._gram[key] = gram_blocks(trace.o_proj, trace.n_kv_heads, trace.group_size,
                                          trace.keys.shape[2])
        return self._gram[key]


def query_chunk(n_heads: int, n_query: int, n_positions: int,
                budget_bytes: int | None = None) -> int:
    """Evaluated queries per pass so that the ``(n_heads, chunk, P)`` float64 logits stay under
    ``budget_bytes`` (default :data:`LOGIT_BUDGET_BYTES`; at least one query, all of them when
    they fit)."""
    budget_bytes = LOGIT_BUDGET_BYTES if budget_bytes is None else int(budget_bytes)
    per_query = n_heads * n_positions * 8  # float64 bytes (float32 mode: half the budget)
    return int(min(n_query, max(1, budget_bytes // max(per_query, 1))))


def _chunk_events(ev_qptr: np.ndarray, ev_q: np.ndarray, q0: int,
                  q1: int) -> tuple[np.ndarray, np.ndarray]:
    """The event -> query lists restricted to queries ``[q0, q1)``, renumbered from 0."""
    n_ev = ev_qptr.size - 1
    ptr = np.zeros(n_ev + 1, dtype=np.int64)
    rows = []
    for e in range(n_ev):
        members = ev_q[ev_qptr[e]:ev_qptr[e + 1]]
        members = members[(members >= q0) & (members < q1)] - q0
        rows.append(members)
        ptr[e + 1] = ptr[e] + members.size
    return ptr, (np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64))


def replay_layer(trace: LayerTrace, policies: list[Policy], seeds: np.ndarray,
                 n_layers: int, options: ReplayOptions | None = None,
                 setup: ReplaySetup | None = None) -> LayerResult:
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
        Ignored when ``setup`` is given (its options are used).
    setup : ReplaySetup, optional
        Shared set-up of a replay over many layers (built here when omitted).

    Returns
    -------
    LayerResult
        Its ``trace`` is the layer the policies were replayed on: ``trace`` itself, or its
        per-query-head view when the policies draw one sample per query head.

    Raises
    ------
    ValueError
        When the policies mix one sample per KV head with one per query head on a layer of
        more than one query head per KV head (use :func:`replay_layer_runs`).

    Notes
    -----
    Long contexts are replayed in passes over chunks of the evaluated queries
    (:func:`query_chunk`), so the ``(n_heads, queries, P)`` logits never exceed
    :data:`LOGIT_BUDGET_BYTES`; every per-query result is independent of the chunking.
    """
    runs = layout_runs(trace, policies)
    if len(runs) > 1:
        raise ValueError("replay_layer: the policies mix one sample per KV head with gqa "
                         "'head' (one sample per query head); replay them with "
                         "replay_layer_runs, one run per layout")
    if policies and policies[0].score.per_query_head:
        trace = trace.per_query_head()
    setup = setup or ReplaySetup(options)
    options = setup.options
    seeds = np.asarray(seeds, dtype=np.int64)
    if seeds.ndim != 1 or seeds.size == 0:
        raise ValueError("seeds must be a non-empty 1-D array of ints")
    if not policies:
        raise ValueError("no policies to replay")
    qidx = evaluated_queries(trace, options.roles)
    qpos = np.ascontiguousarray(trace.query_positions[qidx], dtype=np.int64)
    H, NQ, P = trace.n_heads, qidx.size, trace.n_positions
    n_kv, G, d = trace.n_kv_heads, trace.group_size, trace.keys.shape[2]
    flags = np.array([[p.correction == "hajek", p.certified,
                       p.design is not None and p.design.variance == "fixed"]
                      for p in policies], dtype=np.int64)
    ttab = t_table(options.alpha, P)
    truth = np.empty((H, NQ, d))
    zfull = np.empty((H, NQ))
    # One BLAS thread per numba iteration: no oversubscription, and bit-identical results for
    # any numba thread count (multi-threaded BLAS inside the loop changes the last bits). Every
    # numeric step of the layer runs under the limit.
    with blas_single_thread():
        u = seed_uniforms(seeds, trace.layer, n_kv, P)
        tables = build_inclusion(trace, policies, seeds, qpos, u, n_layers)
        V = np.ascontiguousarray(trace.values, dtype=np.float64)
        vn2 = np.einsum("gpd,gpd->gp", V, V)
        _, pidx = _pairs(G)
        gram = setup.gram(trace)
        if gram is None:
            npairs = pidx.max() + 1
            gblk, vq = np.zeros((n_kv, G, 1, 1)), np.zeros((n_kv, npairs, 1))
            rpack, roff, rstart = np.zeros(0), np.zeros(1, np.int64), np.zeros(1, np.int64)
        else:
            gblk, rpack, roff, rstart = gram.gblk, gram.rpack, gram.roff, gram.rstart
            vq = token_quadratic_forms(V, gram.gam)
        dt = np.dtype(options.precision)
        K = np.ascontiguousarray(trace.keys, dtype=dt)
        if dt != np.float64:
            V = V.astype(dt)
            rpack = rpack.astype(dt)  # the layer error's GEMM too (its sum of squares is float64)
        kmask = tables.kmask if tables.kmask.shape[0] else np.zeros((1, n_kv, P), np.uint8)
        n_it = tables.it_cfg.size
        out = np.empty((n_it, H, NQ, N_FIELDS))
        lout = np.empty((n_it, NQ, N_LAYER_FIELDS))
        n_boot = int(options.bootstrap)
        boot = np.empty((n_it, H, NQ, N_BOOT_FIELDS)) if n_boot else None
        iterations = IterationTables(it_cfg=tables.it_cfg, it_seed=tables.it_seed,
                                     it_slot=tables.it_slot, it_kslot=tables.it_kslot,
                                     flags=flags, u=u, seed_values=seeds, layer=int(trace.layer))
        certificate = CertificateConstants(z_wald=setup.z, t_table=ttab,
                                           want_trv2=bool(options.satterthwaite))
        output_space = OutputSpace(gblk=gblk, vq=vq, pidx=pidx, rpack=rpack, roff=roff,
                                   rstart=rstart)
        step = query_chunk(H, NQ, P)
        Q = np.ascontiguousarray(trace.queries[:, qidx], dtype=dt)
        for q0 in range(0, NQ, step):
            q1 = min(NQ, q0 + step)
            whole = q0 == 0 and q1 == NQ
            if whole:
                ev_qptr, ev_q = tables.ev_qptr, tables.ev_q
            else:
                ev_qptr, ev_q = _chunk_events(tables.ev_qptr, tables.ev_q, q0, q1)
            nq = q1 - q0
            qp = qpos[q0:q1]
            E = np.empty((H, nq, P), dtype=dt)
            zsink = np.zeros((H, nq))
            if trace.is_plain:
                exp_logits_kernel(np.ascontiguousarray(Q[:, q0:q1]), K, qp, float(trace.scale),
                                  G, E)
            else:
                variant_exp_logits(trace, Q[:, q0:q1], qp, E, zsink)
            check_exp_range(E, qp, f"sequence {trace.sequence_id!r} layer {trace.layer}",
                            window=trace.window or 0)
            tr = np.empty((H, nq, d))
            zf = np.empty((H, nq))
            truth_kernel(E, V, np.arange(nq, dtype=np.int64), zsink, tr, zf)
            layer = ChunkTensors(E=E, zfull=zf, V=V, vn2=vn2, truth=tr, qpos=qp, zsink=zsink,
                                 window=int(trace.window or 0))
            incl = InclusionArrays(pi=tables.pi, tau=tables.tau, ev_qptr=ev_qptr, ev_q=ev_q,
                                   slot_ev=tables.slot_ev, kmask=kmask,
                                   ev_stream=tables.ev_stream)
            o = out if whole else np.empty((n_it, H, nq, N_FIELDS))
            lo = lout if whole else np.empty((n_it, nq, N_LAYER_FIELDS))
            replay_kernel(layer, incl, iterations, certificate, event_parts(layer, incl),
                          output_space, ReplayOutputs(out=o, lout=lo))
            if boot is not None:
                bo = boot if whole else np.empty((n_it, H, nq, N_BOOT_FIELDS))
                bootstrap_kernel(layer, incl, iterations, setup.z, n_boot, bo)
                if not whole:
                    boot[:, :, q0:q1] = bo
            del E, layer  # the next chunk's logits must not coexist with these
            truth[:, q0:q1] = tr
            zfull[:, q0:q1] = zf
            if not whole:
                out[:, :, q0:q1] = o
                lout[:, q0:q1] = lo
        check = np.full((H, NQ), np.nan)
        if trace.outputs is not None:
            check = np.abs(trace.outputs[:, qidx] - truth).max(axis=2)
        truth_norm = np.linalg.norm(truth, axis=2)
        bounds = _bound_pass(trace, policies, qidx, qpos, tables, kmask, u)
        if boot is not None:
            # Coverage is defined where the Wald column is (certified rows with a tail).
            boot[..., B_COV] = np.where(np.isnan(out[..., F_WALD]), np.nan, boot[..., B_COV])
    return LayerResult(trace=trace, policies=list(policies), out=out, lout=lout, tables=tables,
                       query_index=qidx, query_positions=qpos,
                       query_roles=[trace.query_roles[i] for i in qidx], output_check=check,
                       truth_norm=truth_norm, seeds=seeds, options=options, bounds=bounds,
                       boot=boot)


def layout_runs(trace: LayerTrace, policies: list[Policy]) -> list[list[Policy]]:
    """The policies cut into runs of consecutive ones that share a sample layout (one sample
    per KV head, or per query head); one run when the layer's group size is 1, where the two
    layouts are the same."""
    if trace.group_size == 1:
        return [list(policies)] if policies else []
    runs: list[list[Policy]] = []
    for p in policies:
        if runs and runs[-1][0].score.per_query_head == p.score.per_query_head:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def replay_layer_runs(trace: LayerTrace, policies: list[Policy], seeds: np.ndarray,
                      n_layers: int, options: ReplayOptions | None = None,
                      setup: ReplaySetup | None = None) -> list[LayerResult]:
    """:func:`replay_layer` of every run of :func:`layout_runs`, in order.

    Every (policy, seed) is replayed independently, so a policy's results do not depend on
    the run it is replayed in; the runs' rows, concatenated, follow the order of ``policies``.
    """
    setup = setup or ReplaySetup(options)
    if not policies:
        raise ValueError("no policies to replay")
    return [replay_layer(trace, run, seeds, n_layers, setup=setup)
            for run in layout_runs(trace, policies)]


def _bound_pass(trace: LayerTrace, policies: list[Policy], qidx: np.ndarray, qpos: np.ndarray,
                tables: InclusionTables, kmask: np.ndarray, u: np.ndarray) -> np.ndarray | None:
    """The page-summary bound of every iteration (``None`` if no policy keeps summaries)."""
    page = np.array([p.summary_page for p in policies], dtype=np.int64)
    if not (page > 0).any():
        return None
    corrected = np.array([p.correction == "hajek" for p in policies], dtype=np.bool_)
    out = np.empty((tables.it_cfg.size, trace.n_heads, qidx.size, N_BOUND_FIELDS))
    bound_kernel(BoundLayer(np.ascontiguousarray(trace.queries[:, qidx], dtype=np.float64),
                            np.ascontiguousarray(trace.keys, dtype=np.float64),
                            np.ascontiguousarray(trace.values, dtype=np.float64), qpos,
                            float(trace.scale), tables.pi, tables.ev_qptr, tables.ev_q,
                            tables.slot_ev, kmask, u),
                 BoundIterations(tables.it_cfg, tables.it_seed, tables.it_slot, tables.it_kslot,
                                 corrected, page),
                 out)
    return out
