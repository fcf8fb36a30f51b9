"""Compiled replay kernel: every (policy, seed) against one layer's shared logits.

The engine computes ``E[h, q, p] = exp(s_hqp - max_p s_hqp)`` (causal zeros) once per layer, so
a policy's Hájek weight of a kept token is just ``E / pi``: no logits and no exponentials are
recomputed per policy or seed. For one (iteration, KV head, event) *unit* the kernel

1. gathers the kept tokens (tail ``pi < 1`` first, then take-all, each in position order),
2. builds the weight matrices of the group's heads and the event's queries (rows) over the
   kept *tail* tokens (columns): ``w``, ``(1-pi) w^2`` and, for the output-space certificate,
   ``(1-pi) w_a w_b`` across the group's head pairs; the take-all part of the estimate
   (``sum_{pi >= 1} E v`` and ``sum E``) is the event's, computed once for all seeds by
   :func:`tracesim.kernels.replay_events.take_all_kernel` (only a fixed-size mask that drops
   a take-all token falls back to the whole kept set),
3. multiplies them with the kept values (BLAS dgemm, one thread per iteration; units of at
   most ``FUSED_ROWS`` rows in one pass over the kept rows in place,
   :mod:`tracesim.kernels.replay_fused`, four tokens at a time when every kept token is a
   tail token, :mod:`tracesim.kernels.fused_tiles`), and
4. finishes each row: estimate, error, certificates, coverage, oracle diagnostics.

Certificates use the running sums ``S2 - 2 o.S1 + |o|^2 S0`` (see ``tracesim.estimators``),
whose per-row reductions are in :mod:`tracesim.kernels.replay_rows`; the output-space
certificate and the layer error are in :mod:`tracesim.kernels.replay_output_space`. The
operands come in named tuples documented in :mod:`tracesim.kernels.replay_operands`. One unit
is :func:`tracesim.kernels.replay_unit.replay_unit`; this module drives the units over the
iterations (with the output space, each iteration's layer error is one GEMM of its own).

Each iteration writes only its own output slots and calls BLAS single-threaded (the caller
sets the BLAS thread limit), so results are bit-identical for any number of numba threads and
any order of iterations.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from tracesim.kernels.replay_events import event_kept
from tracesim.kernels.replay_operands import IterationOutputs, KeptUnit
from tracesim.kernels.replay_output_space import layer_error
from tracesim.kernels.replay_unit import (  # noqa: F401  (the fields' numbers, re-exported)
    F_CERT2,
    F_CERT2_SMALL,
    F_ERR2,
    F_EV_MASS,
    F_EV_MAX,
    F_EVENT,
    F_EXPECTED,
    F_KEPT,
    F_MAX_TAIL,
    F_NEFF,
    F_OUT_MASS,
    F_OUT_MAX,
    F_POP,
    F_REL,
    F_TAIL,
    F_TRV2,
    F_WALD,
    F_WALD_T,
    L_CERT2,
    L_ERR2,
    N_FIELDS,
    N_LAYER_FIELDS,
    replay_unit,
)


@nb.njit(cache=True)
def _iteration(layer, incl, its, cert, ev, osp, res, it, errT):
    """Replay iteration ``it`` (one policy and seed): every (KV head, event) unit, into
    ``res.out[it]``, ``res.lout[it, :, L_CERT2]`` and the errors ``errT`` (Hd, NQ)."""
    pi, ev_qptr, ev_q, slot_ev = incl.pi, incl.ev_qptr, incl.ev_q, incl.slot_ev
    lout = res.lout
    P = layer.E.shape[2]
    NQ = errT.shape[1]
    use_os = osp.rpack.size > 0
    c = its.it_cfg[it]
    corrected = its.flags[c, 0] == 1
    certify = its.flags[c, 1] == 1
    fixed_var = its.flags[c, 2] == 1
    s = its.it_seed[it]
    slot = its.it_slot[it]
    ks = its.it_kslot[it]
    lcert = np.zeros(NQ)
    keptflag = np.empty(P, dtype=np.bool_)
    kept_idx = np.empty(P, dtype=np.int64)
    ufresh = np.empty(P)
    written = IterationOutputs(res.out[it], errT, lcert)
    for g in range(layer.V.shape[0]):
        for e in range(slot_ev[slot], slot_ev[slot + 1]):
            qrows = ev_q[ev_qptr[e]:ev_qptr[e + 1]]
            if qrows.size == 0:
                continue
            mt, m, kb, ex = event_kept(incl, e, g, s, ks, its.u, its.seed_values, its.layer,
                                       keptflag, kept_idx, ufresh)
            kept = KeptUnit(qrows, ev_qptr[e], g, pi[e, g], keptflag, kept_idx, mt, m, kb, ex,
                            e - slot_ev[slot], ev.nta[e, g], corrected, certify, fixed_var)
            replay_unit(layer, ev, osp, cert, kept, written)
    for q in range(NQ):
        lout[it, q, L_ERR2] = np.nan
        lout[it, q, L_CERT2] = lcert[q] if (certify and use_os) else np.nan


@nb.njit(cache=True)
def _iteration_with_error(layer, incl, its, cert, ev, osp, res, it):
    """Iteration ``it`` and, with the output space, its layer error: one GEMM per row block
    over the iteration's own query columns. The errors are allocated here rather than in the
    parallel loop's body (numba may hoist an allocation of loop-invariant size out of a
    parallel loop, numba issue 9529); without the output space nothing reads them."""
    errT = np.zeros((layer.E.shape[0] * layer.V.shape[2], layer.E.shape[1]), osp.rpack.dtype)
    _iteration(layer, incl, its, cert, ev, osp, res, it, errT)
    if osp.rpack.size > 0:
        lerr = np.empty(errT.shape[1])
        layer_error(errT, osp.rpack, osp.roff, osp.rstart, lerr)
        for q in range(lerr.size):
            res.lout[it, q, L_ERR2] = lerr[q]


@nb.njit(cache=True, parallel=True)
def replay_kernel(layer, incl, its, cert, ev, osp, res):
    """Replay every iteration (policy, seed) over one chunk of a layer's queries; see the
    module docstring.

    Parameters
    ----------
    layer : ChunkTensors
        Exp-logits, normalisers, values, ``|v|^2``, truth and query positions.
    incl : InclusionArrays
        Inclusion probabilities, event times, event -> query lists, slots, fixed-size kept
        masks and per-step streams.
    its : IterationTables
        The (policy, seed) iterations, the policies' flags, the permanent uniforms, the seeds
        and the layer index (fresh per-step uniforms are drawn here, per unit).
    cert : CertificateConstants
        Wald and Student quantiles, ``tr(V_hat^2)`` on or off.
    ev : EventParts
        From :func:`tracesim.kernels.replay_events.event_parts`.
    osp : OutputSpace
        Gram blocks, quadratic forms and the layer error's packed triangular factor
        (:func:`tracesim.kernels.replay_output_space.layer_error`; empty
        ``rpack`` = off).
    res : ReplayOutputs
        Written: ``out[it]`` and ``lout[it]`` of every iteration.
    """
    # One GEMM per iteration for its layer error, never one over several iterations' columns:
    # BLAS kernels may round a column by its place in the product (OpenBLAS's AVX-512 dgemm
    # does), so a shared product made a policy's layer error depend on the policies replayed
    # with it. The iteration is a function of its own: written inline in the loop's body,
    # reading the outputs' fields there, it lost every layer error (numba's parfor pass
    # dropping stores, as kernels/attention.py records for fields read inside prange).
    for it in nb.prange(its.it_cfg.size):
        _iteration_with_error(layer, incl, its, cert, ev, osp, res, it)
