"""The replay kernel's operands, grouped: what each array is, its dtype and its shape, once.

:func:`tracesim.kernels.replay.replay_kernel` takes seven of these groups instead of three
dozen loose arrays; numba compiles a named tuple of arrays into a struct of array views, so
reading a field costs nothing and every operation is the one it was with loose arguments.
Symbols used in the shapes:

``H``
    query heads of the layer; ``n_kv`` KV heads, ``G = H // n_kv`` query heads per KV head.
``NQ``
    evaluated queries of the chunk being replayed; ``P`` positions; ``d`` head dimension.
``n_events``, ``n_slots``, ``n_kslots``, ``n_iter``, ``n_cfg``, ``S``
    events of every slot together, slots (one set of inclusion probabilities each), kept masks
    of fixed-size designs, (policy, seed) iterations, policies, seeds.
``n_event_queries``
    ``ev_q.size``: every (event, query) membership, so a query counts once per slot.
``n_pairs``
    ``G (G + 1) / 2`` head pairs of a GQA group (diagonal pairs first).

"Float" below is the replay precision (float64, or float32 in the float32 mode); every
normaliser, sum of squares and certificate term is float64 whatever the precision.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class ChunkTensors(NamedTuple):
    """The layer's tensors for one chunk of queries, shared by every iteration.

    Attributes
    ----------
    E : ndarray of float, shape (H, NQ, P)
        ``exp(s_hqp - max_p s_hqp)``, 0 at positions after the query (causal) and before its
        window on a sliding layer; ``s`` soft-capped when the layer is.
    zfull : ndarray of float64, shape (H, NQ)
        Full-cache normalisers ``sum_p E[h, q, p]``.
    V : ndarray of float, shape (n_kv, P, d)
        Values.
    vn2 : ndarray of float64, shape (n_kv, P)
        ``|v_p|^2`` of the float64 values.
    truth : ndarray of float64, shape (H, NQ, d)
        Full-cache outputs.
    qpos : ndarray of int64, shape (NQ,)
        Query positions.
    zsink : ndarray of float64, shape (H, NQ)
        ``exp(sink_h - max)`` on the scale of ``E``: the learned sink's take-all share of every
        normaliser (``zfull`` includes it); zeros for a layer without sinks.
    window : int
        ``w > 0``: a sliding layer, the query at ``t`` attends ``(t - w, t]`` (``E`` is 0
        before it); 0 for a full layer.
    """

    E: np.ndarray
    zfull: np.ndarray
    V: np.ndarray
    vn2: np.ndarray
    truth: np.ndarray
    qpos: np.ndarray
    zsink: np.ndarray
    window: int


class InclusionArrays(NamedTuple):
    """Inclusion tables of every slot and event (see
    :class:`tracesim.replay.inclusion.InclusionTables`), restricted to the chunk's queries.

    Attributes
    ----------
    pi : ndarray of float64, shape (n_events, n_kv, P)
        Inclusion probabilities after each event.
    tau : ndarray of int64, shape (n_events,)
        Event times (the cache holds positions ``< tau``).
    ev_qptr : ndarray of int64, shape (n_events + 1,)
        Event ``e``'s queries are ``ev_q[ev_qptr[e]:ev_qptr[e + 1]]``.
    ev_q : ndarray of int64, shape (n_event_queries,)
        Query indices (into the chunk's queries), grouped by event.
    slot_ev : ndarray of int64, shape (n_slots + 1,)
        Slot ``k``'s events are ``slot_ev[k]:slot_ev[k + 1]``.
    kmask : ndarray of uint8, shape (max(n_kslots, 1), n_kv, P)
        Kept sets of fixed-size designs (one zero mask when there is none).
    ev_stream : ndarray of int64, shape (n_events,)
        -1 where the kept set is ``u < pi`` with the permanent uniforms, else the stream of
        the event's fresh per-step uniforms (:func:`tracesim.prn.step_uniforms_into`).
    """

    pi: np.ndarray
    tau: np.ndarray
    ev_qptr: np.ndarray
    ev_q: np.ndarray
    slot_ev: np.ndarray
    kmask: np.ndarray
    ev_stream: np.ndarray


class IterationTables(NamedTuple):
    """The (policy, seed) iterations, each policy's rules and the random numbers.

    Attributes
    ----------
    it_cfg, it_seed, it_slot, it_kslot : ndarray of int64, shape (n_iter,)
        Policy index, seed index, slot and kept-mask slot (-1: rule ``u < pi``) of each
        iteration.
    flags : ndarray of int64, shape (n_cfg, 3)
        Per policy, 1 or 0: Hájek-corrected, certified, fixed-size (Rosén) variance.
    u : ndarray of float64, shape (S, n_kv, P)
        Permanent uniforms (stream 0).
    seed_values : ndarray of int64, shape (S,)
        The seeds, from which fresh per-step uniforms are drawn.
    layer : int
        Layer index (a coordinate of the fresh per-step uniforms).
    """

    it_cfg: np.ndarray
    it_seed: np.ndarray
    it_slot: np.ndarray
    it_kslot: np.ndarray
    flags: np.ndarray
    u: np.ndarray
    seed_values: np.ndarray
    layer: int


class CertificateConstants(NamedTuple):
    """Constants of the coverage events.

    Attributes
    ----------
    z_wald : float
        Normal quantile ``z_{1 - alpha/2}`` of the coordinate-wise Wald event.
    t_table : ndarray of float64, shape (P + 2,)
        Student quantiles ``t_{m-1}(1 - alpha/2)`` by tail size ``m`` (inf for ``m <= 1``).
    want_trv2 : bool
        Compute ``tr(V_hat^2)`` (Satterthwaite; ``O(m d^2)`` per row).
    """

    z_wald: float
    t_table: np.ndarray
    want_trv2: bool


class EventParts(NamedTuple):
    """Seed-independent per-event results (:mod:`tracesim.kernels.replay_events`).

    Attributes
    ----------
    stats : ndarray of float64, shape (n_event_queries, H, N_STATS)
        Oracle statistics (tail population, evicted and eligible mass), from
        :func:`tracesim.kernels.replay_events.event_stats_kernel`.
    top : ndarray of int64, shape (n_event_queries, H, TOP_ELIGIBLE)
        Heaviest eligible positions, -1 padded (same kernel).
    xta : ndarray of float64, shape (n_event_queries, H, d)
        Take-all numerators ``sum_{pi >= 1} E v``, from
        :func:`tracesim.kernels.replay_events.take_all_kernel`.
    zta : ndarray of float64, shape (n_event_queries, H)
        Take-all normalisers ``sum_{pi >= 1} E`` (same kernel).
    nta : ndarray of int64, shape (n_events, n_kv)
        Number of take-all tokens (same kernel).
    """

    stats: np.ndarray
    top: np.ndarray
    xta: np.ndarray
    zta: np.ndarray
    nta: np.ndarray


class OutputSpace(NamedTuple):
    """Operands of the output-space (GQA) certificate and the layer error
    (:class:`tracesim.replay.output_space.GramBlocks`); an empty ``rpack`` turns both off.

    Attributes
    ----------
    gblk : ndarray of float64, shape (n_kv, G, d, G * d)
        Row blocks of each group's ``W_g^T W_g`` (placeholder ``(n_kv, G, 1, 1)`` when off).
    vq : ndarray of float64, shape (n_kv, n_pairs, P)
        ``v_p^T Gamma_pair v_p`` (placeholder ``(n_kv, n_pairs, 1)`` when off).
    pidx : ndarray of int64, shape (G, G)
        Pair index of heads ``(a, b)`` within a group (diagonal pairs ``0..G-1``, then cross).
    rpack : ndarray of float, shape (n_packed,)
        Row blocks ``R[r0:r1, r0:]`` of the triangular factor of ``o_proj``, row-major.
    roff : ndarray of int64, shape (n_blocks + 1,)
        Offsets of the blocks in ``rpack``.
    rstart : ndarray of int64, shape (n_blocks + 1,)
        First row of each block (and the number of rows of ``R`` last).
    """

    gblk: np.ndarray
    vq: np.ndarray
    pidx: np.ndarray
    rpack: np.ndarray
    roff: np.ndarray
    rstart: np.ndarray


class ReplayOutputs(NamedTuple):
    """What the replay kernel writes (field indices in :mod:`tracesim.kernels.replay`).

    Attributes
    ----------
    out : ndarray of float64, shape (n_iter, H, NQ, N_FIELDS)
        Per iteration, head and query: error, certificates, coverage and oracle diagnostics.
    lout : ndarray of float64, shape (n_iter, NQ, N_LAYER_FIELDS)
        Per iteration and query, output space: layer error and certificate (NaN when off).
    """

    out: np.ndarray
    lout: np.ndarray


class KeptUnit(NamedTuple):
    """One (iteration, KV head, event) unit of the replay: its kept set and the rules that
    finish its rows (built inside the kernel, one per unit).

    Attributes
    ----------
    qrows : ndarray of int64, shape (nqe,)
        The event's queries (indices into the chunk's queries).
    j0 : int
        Offset of the event's first query in the per-event arrays (``ev_qptr[e]``).
    g : int
        KV head.
    pi_row : ndarray of float64, shape (P,)
        The event's inclusion probabilities for head ``g``.
    keptflag : ndarray of bool, shape (P,)
        Kept positions.
    kept_idx : ndarray of int64, shape (P,)
        The first ``m`` entries: kept positions, tail (``pi < 1``) first, each part ascending.
    mt, m : int
        Kept tail tokens and kept tokens.
    kb : int
        Kept tokens before the event time.
    ex : float
        Expected kept tokens before the event time.
    event : int
        Event index within the slot.
    n_take_all : int
        Take-all tokens of the event and head (``EventParts.nta[e, g]``).
    corrected, certify, fixed_var : bool
        The iteration's policy: Hájek-corrected, certified, fixed-size (Rosén) variance.
    """

    qrows: np.ndarray
    j0: int
    g: int
    pi_row: np.ndarray
    keptflag: np.ndarray
    kept_idx: np.ndarray
    mt: int
    m: int
    kb: int
    ex: float
    event: int
    n_take_all: int
    corrected: bool
    certify: bool
    fixed_var: bool


class IterationOutputs(NamedTuple):
    """What one iteration's units write.

    Attributes
    ----------
    out : ndarray of float64, shape (H, NQ, N_FIELDS)
        The iteration's slice of :attr:`ReplayOutputs.out`.
    errT : ndarray of float, shape (H * d, NQ)
        Estimation errors ``o_hat - o``, head-major, for the layer error (one GEMM per
        iteration, see :func:`tracesim.kernels.replay.replay_kernel`); without the output
        space, scratch that is not read.
    lcert : ndarray of float64, shape (NQ,)
        Output-space certificate, accumulated over the groups.
    """

    out: np.ndarray
    errT: np.ndarray
    lcert: np.ndarray


# The name before the rename, kept for one reason: numba's on-disk cache index pickles a
# compiled kernel's argument types by module and name, and unpickles the index before it checks
# whether the index is stale; a cache written before the rename must still unpickle (it is then
# found stale and recompiled) instead of failing with AttributeError. Not for new code.
LayerArrays = ChunkTensors
