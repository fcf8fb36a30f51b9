"""Seed-independent per-event work of the replay: truth, kept-set gathering, oracle statistics.

Everything that depends on a policy's inclusion probabilities but not on the seed is computed
once per (event, KV head) here, so the per-seed kernel (:mod:`tracesim.kernels.replay`) only
touches kept tokens.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from tracesim.kernels.replay_operands import ChunkTensors, EventParts, InclusionArrays
from tracesim.prn import step_uniforms_into

# Fields of the per-(event query, head) statistics.
S_POP, S_EV_MASS, S_EV_MAX, S_ELIG_MASS, S_N_ELIG = range(5)
N_STATS = 5
#: Eligible tail tokens (0 < pi < 1) remembered per row, heaviest first, for the largest
#: sampled-out weight; rows whose TOP_ELIGIBLE heaviest are all kept fall back to a scan.
TOP_ELIGIBLE = 32
#: Kernels whose work (multiply-adds or scanned entries) is below this run serially: a parallel
#: region costs more than it saves on tiny layers, and much more on a loaded machine (measured:
#: 38 ms wall / 8 ms CPU against 1.7 ms / 0.4 ms serial for 98k permanent uniforms at load 13).
SERIAL_BELOW = 1 << 22


@nb.njit(cache=True)
def gather_kept(pi_row, u_row, kmask_row, use_mask, tau, keptflag, kept_idx):
    """Kept positions into ``kept_idx``: tail (pi < 1) first, then take-all, ascending.

    Returns ``(m_tail, m, kept_before_tau, expected_before_tau)``.
    """
    P = pi_row.size
    mt = 0
    for p in range(P):
        pv = pi_row[p]
        k = (kmask_row[p] != 0) if use_mask else (u_row[p] < pv)
        keptflag[p] = k
        if k and pv < 1.0:
            kept_idx[mt] = p
            mt += 1
    m = mt
    kb = 0
    ex = 0.0
    for p in range(P):
        if keptflag[p]:
            if pi_row[p] >= 1.0:
                kept_idx[m] = p
                m += 1
            if p < tau:
                kb += 1
        if p < tau:
            ex += pi_row[p]
    return mt, m, kb, ex


@nb.njit(cache=True)
def gather_by_rule(pi_row, u_row, tau, keptflag, kept_idx):
    """:func:`gather_kept` for the rule ``u < pi`` (no mask) in one branch-free pass.

    Tail positions are stored from the front of ``kept_idx`` and take-all ones from its end
    (descending), then moved behind the tail, so the kept set, its order, ``kb`` and ``ex``
    (``pi`` added in the same position order) are those of :func:`gather_kept`, bit for bit.
    """
    P = pi_row.size
    mt = 0
    n_ta = 0
    kb = 0
    ex = 0.0
    # Every position is written to both lists' next free slot and the counts advance by the
    # tests: the kept decision is a coin flip, on which branches mispredict. The slots never
    # collide with stored entries (mt + n_ta <= p before position p).
    for p in range(P):
        pv = pi_row[p]
        before = p < tau
        take = pv >= 1.0
        k = u_row[p] < pv
        keptflag[p] = k
        kept_idx[mt] = p
        mt += k and not take
        kept_idx[P - 1 - n_ta] = p
        n_ta += take
        if before:
            ex += pv
            kb += k
    # The take-all block [P - n_ta, P) is descending: reverse it, then shift it left behind
    # the tail (moving left, the destination never passes an unread source entry).
    lo = P - n_ta
    for i in range(n_ta // 2):
        a = kept_idx[lo + i]
        kept_idx[lo + i] = kept_idx[P - 1 - i]
        kept_idx[P - 1 - i] = a
    for i in range(n_ta):
        kept_idx[mt + i] = kept_idx[lo + i]
    return mt, mt + n_ta, kb, ex


@nb.njit(cache=True)
def event_kept(incl, e, g, s, ks, u, seed_values, layer_index, keptflag, kept_idx, ufresh):
    """Kept set of event ``e`` for KV head ``g`` and seed slot ``s`` (:func:`gather_kept`).

    The uniforms are the permanent ones ``u[s, g]``, or, for a fresh per-step sample
    (``incl.ev_stream[e] >= 0``), that step's own stream drawn into ``ufresh`` (shape (P,));
    ``ks >= 0`` reads the fixed-size design's kept mask instead (no uniforms needed). The
    replay kernel and the bootstrap kernel both gather through here, so they resample exactly
    the same set.
    """
    if ks >= 0:
        return gather_kept(incl.pi[e, g], u[s, g], incl.kmask[ks, g], True, incl.tau[e],
                           keptflag, kept_idx)
    urow = u[s, g]
    if incl.ev_stream[e] >= 0:
        step_uniforms_into(seed_values[s], incl.ev_stream[e], layer_index, g, incl.tau[e],
                           ufresh)
        urow = ufresh
    return gather_by_rule(incl.pi[e, g], urow, incl.tau[e], keptflag, kept_idx)


@nb.njit(cache=True)
def estimate_block(E, Vg, qrows, g, G, kept_idx, m, inv):
    """Hájek numerators and normalisers of the group's heads for the given queries.

    Returns ``(We (R, m), Vk (m, d), X (R, d), Z (R,))`` with row ``r = a * G + hh``. The truth
    and every policy go through this function, so ``full`` reproduces the truth bit for bit.
    ``We``, ``Vk`` and the GEMM ``X`` have the dtype of ``Vg`` (float32 in the float32 mode);
    the normalisers ``Z`` are float64 sums.
    """
    nqe = qrows.size
    d = Vg.shape[1]
    R = nqe * G
    Vk = np.empty((m, d), Vg.dtype)
    for j in range(m):
        p = kept_idx[j]
        for k in range(d):
            Vk[j, k] = Vg[p, k]
    We = np.empty((R, m), Vg.dtype)
    Z = np.zeros(R)
    for a in range(nqe):
        q = qrows[a]
        for hh in range(G):
            h = g * G + hh
            r = a * G + hh
            z = 0.0
            for j in range(m):
                w = E[h, q, kept_idx[j]] * inv[j]
                We[r, j] = w
                z += w
            Z[r] = z
    if R > 0 and m > 0:
        X = np.dot(We, Vk)
    else:
        X = np.zeros((R, d), Vg.dtype)
    return We, Vk, X, Z


@nb.njit(cache=True)
def _exp_logits_job(job, Q, KT, qpos, scale, g, G, E):
    """Row ``(h, q)`` of query head ``h = g G + job // NQ``, ``q = job % NQ`` against the keys
    ``KT`` (d, P) of KV head ``g``, transposed.

    Each dot product is summed in the order ``k = 0 .. d-1`` as a plain loop over ``k`` would
    (the loop over positions is the inner one, so the compiler vectorises across positions
    without reassociating any sum): the logits are the same bits as the position-by-position
    loop, which summed one dependent chain per key (``docs/replay.md``, fourth pass: 1.6x less
    CPU time at d = 64, the rest being the ``exp`` calls).
    """
    NQ = Q.shape[1]
    d, P = KT.shape
    h = g * G + job // NQ
    q = job % NQ
    n = max(min(qpos[q] + 1, P), 0)
    acc = np.zeros(n)  # float64 sums, also when Q and K are float32
    for k in range(d):
        qk = Q[h, q, k]
        for p in range(n):
            acc[p] += qk * KT[k, p]
    top = -np.inf
    row = E[h, q]
    for p in range(n):
        a = acc[p] * scale
        row[p] = a
        top = max(top, a)
    for p in range(n):
        row[p] = np.exp(row[p] - top)
    for p in range(n, P):
        row[p] = 0.0


@nb.njit(cache=True, parallel=True)
def _exp_logits_par(Q, KT, qpos, scale, g, G, E):
    for job in nb.prange(G * Q.shape[1]):
        _exp_logits_job(job, Q, KT, qpos, scale, g, G, E)


@nb.njit(cache=True)
def _exp_logits_ser(Q, KT, qpos, scale, g, G, E):
    for job in range(G * Q.shape[1]):
        _exp_logits_job(job, Q, KT, qpos, scale, g, G, E)


def exp_logits_kernel(Q, K, qpos, scale, G, E) -> None:
    """``E[h, q, p] = exp(s - max_p s)`` with ``s = scale q.k_p`` for ``p <= qpos[q]``, else 0.

    ``Q`` (H, NQ, d), ``K`` (n_kv, P, d); query head h uses KV head ``h // G``. One KV head at
    a time: its keys are transposed (a copy of one head's keys), then its group's rows are
    computed, in parallel over the rows unless the group's work is small (see
    :data:`SERIAL_BELOW`); every row computes the same either way.
    """
    work = G * Q.shape[1] * K.shape[1] * Q.shape[2]
    fn = _exp_logits_ser if work < SERIAL_BELOW else _exp_logits_par
    for g in range(K.shape[0]):
        fn(Q, np.ascontiguousarray(K[g].T), qpos, scale, g, G, E)


def check_exp_range(E: np.ndarray, qpos: np.ndarray, where: str, head0: int = 0,
                    window: int = 0) -> None:
    """Refuse exp-logits that underflowed to exactly 0 on a visible key.

    ``E`` holds ``exp(s - max s)``: when the scaled logits of one query span more than the
    exponent range (about 745 in float64, 103 in float32), keys visible to it get weight 0.
    A kept set made only of such keys has normaliser 0, and the estimators divide by it (in a
    compiled kernel that surfaces as a ``SystemError``). Real attention logits span tens, so
    this means keys or queries of absurd size: a clear error beats a silent NaN.

    Parameters
    ----------
    E : ndarray, shape (H, NQ, P)
    qpos : ndarray, shape (NQ,)
        Query positions (negative: sees every key).
    where : str
        Names the sequence and layer in the message.
    head0 : int
        Query head of ``E[0]`` (for callers that pass one head at a time).
    window : int
        ``w > 0``: a sliding layer; keys before ``(t - w, t]`` are not visible.

    Raises
    ------
    ValueError
        Naming the head, query position and the number of underflowed keys.
    """
    P = E.shape[2]
    last = np.where(qpos < 0, P - 1, qpos)
    visible = np.arange(P)[None, :] <= last[:, None]
    if window > 0:
        visible &= np.arange(P)[None, :] > (last - window)[:, None]
    zero = (E == 0.0) & visible[None]
    if zero.any():
        h, a, p = (int(x) for x in np.argwhere(zero)[0])
        h += head0
        raise ValueError(
            f"{where}: fields 'keys'/'queries' give head {h} at query position {int(qpos[a])} "
            f"attention logits spanning beyond the {E.dtype} exponent range ({int(zero.sum())} "
            f"visible weight(s) underflow to 0, first at key {p}), expected scaled logits "
            "q.k*scale within about 700 of each other (keys/queries this large are not from "
            "a model)")


def check_logit_span(K: np.ndarray, Q: np.ndarray, qpos: np.ndarray, scale: float, G: int,
                     where: str) -> None:
    """:func:`check_exp_range` for kernels that exponentiate logits themselves (``tiers``).

    Computes ``exp(s - max s)`` one head at a time in float64, as those kernels do, and refuses
    the layer if a visible key's weight underflows to 0. ``K`` (n_kv, P, d), ``Q`` (H, NQ, d).
    """
    H, NQ = Q.shape[0], Q.shape[1]
    P = K.shape[1]
    last = np.where(qpos < 0, P - 1, qpos)
    hidden = np.arange(P)[None, :] > last[:, None]
    for h in range(H):
        s = (Q[h].astype(np.float64) @ K[h // G].astype(np.float64).T) * scale
        s[hidden] = -np.inf
        E = np.exp(s - s.max(axis=1, keepdims=True))
        check_exp_range(E.reshape(1, NQ, P), qpos, where, head0=h)


@nb.njit(cache=True)
def _truth_job(g, E, V, qrows, zsink, truth, zfull):
    H = E.shape[0]
    n_kv, P, d = V.shape
    G = H // n_kv
    kept_idx = np.arange(P)
    inv = np.ones(P)
    We, Vk, X, Z = estimate_block(E, V[g], qrows, g, G, kept_idx, P, inv)
    for a in range(qrows.size):
        q = qrows[a]
        for hh in range(G):
            r = a * G + hh
            z = Z[r] + zsink[g * G + hh, q]  # the sink: in the normaliser only (+0.0 without)
            for k in range(d):
                truth[g * G + hh, q, k] = X[r, k] / z
            zfull[g * G + hh, q] = z


@nb.njit(cache=True, parallel=True)
def _truth_par(E, V, qrows, zsink, truth, zfull):
    for g in nb.prange(V.shape[0]):
        _truth_job(g, E, V, qrows, zsink, truth, zfull)


@nb.njit(cache=True)
def _truth_ser(E, V, qrows, zsink, truth, zfull):
    for g in range(V.shape[0]):
        _truth_job(g, E, V, qrows, zsink, truth, zfull)


def truth_kernel(E, V, qrows, zsink, truth, zfull) -> None:
    """Full-cache outputs (H, NQ, d) and normalisers (H, NQ) through :func:`estimate_block`;
    ``zsink`` (H, NQ) is each normaliser's sink share (zeros without sinks)."""
    work = E.shape[0] * qrows.size * V.shape[1] * V.shape[2]
    (_truth_ser if work < SERIAL_BELOW else _truth_par)(E, V, qrows, zsink, truth, zfull)


@nb.njit(cache=True)
def _event_stats_job(job, E, zfull, pi, ev_qptr, ev_q, qpos, G, stats, top, window):
    H, NQ, P = E.shape
    e = job // H
    h = job % H
    g = h // G
    prow = pi[e, g]
    for j in range(ev_qptr[e], ev_qptr[e + 1]):
        q = ev_q[j]
        t = qpos[q]
        zf = zfull[h, q]
        pop = 0
        em = 0.0
        ex_max = 0.0
        el = 0.0
        n_el = 0
        # A sliding layer's population is its window (t - w, t].
        for p in range(max(t - window + 1, 0) if window > 0 else 0, min(t + 1, P)):
            pv = prow[p]
            if pv < 1.0:
                pop += 1
                w = E[h, q, p]
                if pv > 0.0:
                    el += w
                    n_el += 1
                else:
                    em += w
                    ex_max = max(ex_max, w)
        # Normalised once at the end (a division per token would dominate the loop).
        stats[j, h, S_POP] = pop
        stats[j, h, S_EV_MASS] = em / zf
        stats[j, h, S_EV_MAX] = ex_max / zf
        stats[j, h, S_ELIG_MASS] = el / zf
        stats[j, h, S_N_ELIG] = n_el
        _top_eligible(E[h, q], prow, min(t + 1, P), top[j, h])


@nb.njit(cache=True, parallel=True)
def _event_stats_par(E, zfull, pi, ev_qptr, ev_q, qpos, G, stats, top, window):
    for job in nb.prange((ev_qptr.size - 1) * E.shape[0]):
        _event_stats_job(job, E, zfull, pi, ev_qptr, ev_q, qpos, G, stats, top, window)


@nb.njit(cache=True)
def _event_stats_ser(E, zfull, pi, ev_qptr, ev_q, qpos, G, stats, top, window):
    for job in range((ev_qptr.size - 1) * E.shape[0]):
        _event_stats_job(job, E, zfull, pi, ev_qptr, ev_q, qpos, G, stats, top, window)


def event_stats_kernel(E, zfull, pi, ev_qptr, ev_q, qpos, G, stats, top, window=0) -> None:
    """Oracle statistics of every (event query, head) that do not depend on the seed.

    ``window > 0``: a sliding layer, whose population at ``t`` is ``(t - window, t]``.
    ``stats`` (n_event_queries, H, N_STATS): tail population (visible tokens with pi < 1),
    evicted (pi = 0) mass and largest weight, eligible (0 < pi < 1) mass and count.
    ``top`` (n_event_queries, H, TOP_ELIGIBLE): eligible positions, heaviest first, -1 padded.
    """
    work = ev_q.size * E.shape[0] * E.shape[2]
    (_event_stats_ser if work < SERIAL_BELOW else _event_stats_par)(
        E, zfull, pi, ev_qptr, ev_q, qpos, G, stats, top, int(window))


@nb.njit(cache=True)
def _top_eligible(erow, prow, n, out):
    """The ``out.size`` heaviest eligible (0 < pi < 1) positions, heaviest first (-1 padded).

    Insertion into a short sorted list: O(n) for typical rows (most tokens are lighter than the
    current K-th and rejected at once). Ties keep the earlier position first.
    """
    K = out.size
    wts = np.empty(K)
    count = 0
    for p in range(n):
        if not 0.0 < prow[p] < 1.0:
            continue
        w = erow[p]
        if count == K and w <= wts[K - 1]:
            continue
        i = count if count < K else K - 1
        while i > 0 and wts[i - 1] < w:
            if i < K:
                wts[i] = wts[i - 1]
                out[i] = out[i - 1]
            i -= 1
        wts[i] = w
        out[i] = p
        if count < K:
            count += 1
    for k in range(count, K):
        out[k] = -1


@nb.njit(cache=True)
def largest_sampled_out(E, h, q, t, zf, prow, keptflag, top_row, n_elig):
    """Largest full-cache weight among eligible (0 < pi < 1) tokens that were not kept."""
    K = top_row.size
    for k in range(min(K, n_elig)):
        p = top_row[k]
        if not keptflag[p]:
            return E[h, q, p] / zf
    if n_elig <= K:
        return 0.0
    best = 0.0
    for p in range(min(t + 1, prow.size)):
        if 0.0 < prow[p] < 1.0 and not keptflag[p]:
            best = max(best, E[h, q, p] / zf)
    return best


@nb.njit(cache=True)
def _take_all_job(job, E, V, pi, ev_qptr, ev_q, G, xta, zta, nta):
    n_kv = V.shape[0]
    e = job // n_kv
    g = job % n_kv
    prow = pi[e, g]
    P = prow.size
    idx = np.empty(P, dtype=np.int64)
    n = 0
    for p in range(P):
        if prow[p] >= 1.0:
            idx[n] = p
            n += 1
    nta[e, g] = n
    qrows = ev_q[ev_qptr[e]:ev_qptr[e + 1]]
    if qrows.size == 0:
        return
    inv = np.ones(n)
    _, _, X, Z = estimate_block(E, V[g], qrows, g, G, idx, n, inv)
    d = V.shape[2]
    for a in range(qrows.size):
        for hh in range(G):
            r = a * G + hh
            for k in range(d):
                xta[ev_qptr[e] + a, g * G + hh, k] = X[r, k]
            zta[ev_qptr[e] + a, g * G + hh] = Z[r]


@nb.njit(cache=True, parallel=True)
def _take_all_par(E, V, pi, ev_qptr, ev_q, G, xta, zta, nta):
    for job in nb.prange((ev_qptr.size - 1) * V.shape[0]):
        _take_all_job(job, E, V, pi, ev_qptr, ev_q, G, xta, zta, nta)


@nb.njit(cache=True)
def _take_all_ser(E, V, pi, ev_qptr, ev_q, G, xta, zta, nta):
    for job in range((ev_qptr.size - 1) * V.shape[0]):
        _take_all_job(job, E, V, pi, ev_qptr, ev_q, G, xta, zta, nta)


def take_all_kernel(E, V, pi, ev_qptr, ev_q, G, xta, zta, nta) -> None:
    """The take-all (pi >= 1) part of every event's estimates, shared by all seeds.

    ``xta`` (n_event_queries, H, d) and ``zta`` (n_event_queries, H): numerator
    ``sum_{pi_i >= 1} exp(s_i) v_i`` and normaliser ``sum_{pi_i >= 1} exp(s_i)`` through
    :func:`estimate_block` (so a policy that keeps everything reproduces the truth bit for bit);
    ``nta`` (n_events, n_kv): the number of take-all tokens. Every seed keeps all of them (the
    rule ``u < pi`` and the fixed-size masks both do), so the per-seed kernel only adds its
    sampled tail.
    """
    work = ev_q.size * E.shape[0] * E.shape[2] * V.shape[2]
    (_take_all_ser if work < SERIAL_BELOW else _take_all_par)(E, V, pi, ev_qptr, ev_q, G, xta,
                                                              zta, nta)


def event_parts(layer: ChunkTensors, incl: InclusionArrays) -> EventParts:
    """Everything the replay needs per (event, KV head) that does not depend on the seed.

    Parameters
    ----------
    layer : ChunkTensors
        The chunk's exp-logits, normalisers, values and query positions (``truth`` unused).
    incl : InclusionArrays
        Inclusion probabilities and the chunk's event -> query lists.

    Returns
    -------
    EventParts
        Oracle statistics from :func:`event_stats_kernel`, take-all numerators, normalisers
        and counts from :func:`take_all_kernel`.
    """
    H, d = layer.E.shape[0], layer.V.shape[2]
    G = H // layer.V.shape[0]
    n_rows = incl.ev_q.size
    stats = np.empty((n_rows, H, N_STATS))
    top = np.empty((n_rows, H, TOP_ELIGIBLE), dtype=np.int64)
    event_stats_kernel(layer.E, layer.zfull, incl.pi, incl.ev_qptr, incl.ev_q, layer.qpos, G,
                       stats, top, layer.window)
    xta = np.empty((n_rows, H, d))
    zta = np.empty((n_rows, H))
    nta = np.empty((incl.ev_qptr.size - 1, layer.V.shape[0]), dtype=np.int64)
    take_all_kernel(layer.E, layer.V, incl.pi, incl.ev_qptr, incl.ev_q, G, xta, zta, nta)
    return EventParts(stats=stats, top=top, xta=xta, zta=zta, nta=nta)
