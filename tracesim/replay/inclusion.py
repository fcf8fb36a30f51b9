"""From policies to inclusion tables: scores -> budgets -> designs -> schedules, per layer.

Everything here is cheap (O(P log P) per KV head, event and slot) and runs in Python; the
compiled kernel then replays every (policy, seed) against these tables. A *slot* is one set of
inclusion probabilities: one per policy, or one per (policy, seed) when the score itself is
random (``random``, ``keyformer``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracesim.designs import Design
from tracesim.layer_trace import LayerTrace
from tracesim.policies import Policy
from tracesim.prn import permanent_uniforms, step_stream, uniform_grid
from tracesim.schedules import event_of_queries, nested_inclusion

__all__ = ["InclusionTables", "build_inclusion", "event_uniforms", "fixed_kept", "fresh_uniforms",
           "head_inclusion", "seed_uniforms", "slot_events"]


def _usable_scores(x: np.ndarray, n: int) -> np.ndarray:
    # Capped PPS cannot reach n with fewer than n positive scores (attention can underflow to
    # 0): lift zeros to a tiny fraction of the largest score so the budget stays reachable.
    if np.count_nonzero(x > 0) >= n:
        return x
    top = float(x.max()) if x.size else 0.0
    return np.full(x.size, 1.0) if top <= 0 else np.maximum(x, 1e-12 * top)


def _top_later(x: np.ndarray, h: int) -> np.ndarray:
    """Indices of the ``h`` largest of ``x`` (``0 < h < x.size``), the later position first
    among equal values (as TopK), in no particular order.

    The set a stable sort of the reversed scores selects, found in O(N): one partition gives
    the h-th largest value ``v``; every score above ``v`` is in, and of those equal to ``v``
    the last ones fill the remaining places.
    """
    v = np.partition(x, x.size - h)[x.size - h]
    above = np.flatnonzero(x > v)
    ties = np.flatnonzero(x == v)
    return np.concatenate([above, ties[ties.size - (h - above.size):]])


def head_inclusion(scores: np.ndarray, take_all: np.ndarray, design: Design,
                   tail_budget: int, top_fraction: float = 0.0,
                   alive: np.ndarray | None = None, ties: str = "later") -> np.ndarray:
    """Inclusion probabilities of positions ``[0, end)`` for one KV head at one event.

    Parameters
    ----------
    scores : ndarray, shape (end,)
        Non-negative scores.
    take_all : ndarray of bool, shape (end,)
        Sinks and window (``pi = 1``).
    design : Design
    tail_budget : int
        Expected number of tail tokens kept (top-h included).
    top_fraction : float
        Share of ``tail_budget`` given take-all to the highest tail scores (ties: later token).
    alive : ndarray of bool, shape (end,), optional
        Tokens still in the cache; evicted ones get ``pi = 0`` and no budget (deterministic
        decode-time eviction).
    ties : {"later", "earlier"}
        Which of equal scores a deterministic design and the top-h prefer (the score's
        ``ties``); randomized designs are not affected.

    Returns
    -------
    ndarray of float64, shape (end,)
    """
    if ties == "earlier" and not design.randomized:
        # Every rule here is position-symmetric except the tie order: run it on the reversed
        # positions, so "the later position" becomes the earlier one.
        return head_inclusion(scores[::-1], take_all[::-1], design, tail_budget, top_fraction,
                              None if alive is None else alive[::-1])[::-1].copy()
    if ties not in ("later", "earlier"):
        raise ValueError(f"ties = {ties!r}: expected 'later' or 'earlier'")
    end = scores.size
    pi = np.ones(end)
    tail = np.flatnonzero(~take_all if alive is None else (~take_all & alive))
    if alive is not None:
        pi[~alive & ~take_all] = 0.0
    n = min(int(tail_budget), tail.size)
    if n >= tail.size:
        return pi
    if n <= 0:
        pi[tail] = 0.0
        return pi
    x = np.asarray(scores, dtype=np.float64)[tail]
    h = int(round(float(top_fraction) * n))
    if h > 0:
        top = _top_later(x, h)
        keep = np.ones(tail.size, dtype=bool)
        keep[top] = False
        tail, x, n = tail[keep], x[keep], n - h
        if n <= 0:
            pi[tail] = 0.0
            return pi
        if n >= tail.size:
            return pi
    pi[tail] = design.inclusion_probabilities(_usable_scores(x, n), n)
    return pi


def seed_uniforms(seeds: np.ndarray, layer: int, n_kv: int, n_positions: int) -> np.ndarray:
    """Permanent uniforms (stream 0) for every seed, KV head and position: (S, n_kv, P)."""
    return uniform_grid(np.asarray(seeds, dtype=np.int64), layer, n_kv, n_positions)


@dataclass
class InclusionTables:
    """Inclusion probabilities of every slot and event, and the (policy, seed) iterations.

    Attributes
    ----------
    pi : ndarray, shape (n_events, n_kv, P)
        Effective inclusion probabilities after each event (1 for tokens not yet compressed).
    tau : ndarray of int64, shape (n_events,)
        Event times (the cache holds positions < tau when the event fires).
    ev_stream : ndarray of int64, shape (n_events,)
        -1 where the kept set is ``u < pi`` with the permanent uniforms of stream 0; else the
        stream of the event's own uniforms (fresh per-step designs, :func:`event_uniforms`).
    ev_qptr, ev_q : ndarray of int64
        Queries (indices into the evaluated queries) of event e: ``ev_q[ev_qptr[e]:ev_qptr[e+1]]``.
    slot_ev : ndarray of int64, shape (n_slots + 1,)
        Events of slot k: ``slot_ev[k]:slot_ev[k+1]``.
    budget_tokens : ndarray of int64, shape (n_events, n_kv)
        Nominal tokens allocated to each KV head at each event (take-all + tail budget).
    kmask : ndarray of uint8, shape (n_kslots, n_kv, P)
        Kept sets of fixed-size designs (one per (policy, seed)); empty if none.
    it_cfg, it_seed, it_slot, it_kslot : ndarray of int64, shape (n_iter,)
        Iterations: policy index, seed index, slot, kept-mask slot (-1: rule ``u < pi``).
    context : ndarray of int64, shape (n_policies,)
        Compressible range of each policy.
    nominal : ndarray of int64, shape (n_policies,)
        Nominal tokens per KV head (``score.kept_tokens(budget, context)``; the context for
        ``full``).
    """

    pi: np.ndarray
    tau: np.ndarray
    ev_stream: np.ndarray
    ev_qptr: np.ndarray
    ev_q: np.ndarray
    slot_ev: np.ndarray
    budget_tokens: np.ndarray
    kmask: np.ndarray
    it_cfg: np.ndarray
    it_seed: np.ndarray
    it_slot: np.ndarray
    it_kslot: np.ndarray
    context: np.ndarray
    nominal: np.ndarray

    def query_event(self, slot: int) -> np.ndarray:
        """Global event index of every evaluated query under ``slot``."""
        n_q = int(self.ev_qptr[self.slot_ev[slot + 1]] - self.ev_qptr[self.slot_ev[slot]])
        out = np.empty(n_q, dtype=np.int64)
        for e in range(self.slot_ev[slot], self.slot_ev[slot + 1]):
            out[self.ev_q[self.ev_qptr[e]:self.ev_qptr[e + 1]]] = e
        return out


def slot_events(trace: LayerTrace, policy: Policy, seed: int | None, n_layers: int,
                 qpos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inclusion probabilities of every event of one slot (policy, and seed if the score is
    random): ``(pi (E, n_kv, P), tau (E,), budget tokens (E, n_kv))``, ``pi`` nested (running
    minimum over events)."""
    n_kv, P = trace.n_kv_heads, trace.n_positions
    score = policy.score
    if not score.evicts:
        return np.ones((1, n_kv, P)), np.array([trace.prompt_length]), np.full(
            (1, n_kv), trace.prompt_length, dtype=np.int64)
    per_step = policy.schedule.per_step
    L = score.compress_end(trace)
    tau = policy.schedule.event_times(L, trace.prompt_length, int(qpos.max()), qpos)
    # A sliding layer holds its window only: a budget is a share of what it holds at t.
    held = (lambda t: t) if trace.window is None else (lambda t: min(t, trace.window))
    B = score.kept_tokens(policy.budget, held(L))
    # A per-step design redraws from the whole cache at every step: nothing is nested and
    # nothing is gone for good; its budget is a share of the step's own cache [0, t).
    deterministic = not policy.design.randomized and not per_step
    raw = np.ones((tau.size, n_kv, P))
    budgets = np.zeros((tau.size, n_kv), dtype=np.int64)
    for e, t in enumerate(tau):
        t = int(t)
        # Positions the query at t attends on a sliding layer: (t - w, t]; None: every one.
        window = None if trace.window is None else np.arange(t) > t - trace.window
        xs, masks, tails = [], [], []
        for g in range(n_kv):
            x = score.scores(trace, g, t, seed if score.seed_dependent else None)
            a = score.take_all(trace, g, t)
            alive = _alive(raw, e, g, t, deterministic, window)
            if window is not None:
                a = a & window
            xs.append(x)
            masks.append(a)
            tails.append(x[~a] if alive is None else x[~a & alive])
        B_e = score.kept_tokens(policy.budget, held(t)) if per_step else B
        if score.truncate_stratum and B_e < int(masks[0].sum()):
            # A kvpress press protects by score: below the budget it keeps the earliest
            # B_e protected tokens (equal top scores, earlier first), not all of them.
            for g in range(n_kv):
                cut = np.zeros(t, dtype=bool)
                cut[np.flatnonzero(masks[g])[:B_e]] = True
                masks[g] = cut
        tb = max(0, B_e - int(masks[0].sum()))
        alloc = score.tail_budgets(trace, tails, policy.budget.layer_tail_budget(
            tb, trace.layer, n_layers), policy.budget)
        for g in range(n_kv):
            alive = _alive(raw, e, g, t, deterministic, window)
            raw[e, g, :t] = head_inclusion(xs[g], masks[g], policy.design, int(alloc[g]),
                                           score.top_fraction, alive, score.ties)
            budgets[e, g] = int(masks[g].sum()) + int(alloc[g])
    return (raw if per_step else nested_inclusion(raw)), tau, budgets


def _alive(raw: np.ndarray, e: int, g: int, t: int, deterministic: bool,
           window: np.ndarray | None) -> np.ndarray | None:
    """Tokens of ``[0, t)`` still in KV head ``g``'s cache at event ``e``: not evicted by an
    earlier deterministic event, and inside a sliding layer's window (``None``: all)."""
    alive = raw[:e, g, :t].min(axis=0) > 0 if (deterministic and e > 0) else None
    if window is None:
        return alive
    return window if alive is None else alive & window


def build_inclusion(trace: LayerTrace, policies: list[Policy], seeds: np.ndarray,
                    query_positions: np.ndarray, uniforms: np.ndarray,
                    n_layers: int) -> InclusionTables:
    """Build every slot's inclusion tables and the iteration list for one layer.

    Parameters
    ----------
    trace : LayerTrace
    policies : list of Policy
    seeds : ndarray of int, shape (S,)
    query_positions : ndarray of int64, shape (NQ,)
        Evaluated query positions.
    uniforms : ndarray, shape (S, n_kv, P)
        From :func:`seed_uniforms` (fixed-size designs select with them here).
    n_layers : int
        For the PyramidKV schedule.
    """
    pis, taus, streams, budgets, qptr, qlist = [], [], [], [], [0], []
    slot_ev, kmasks = [0], []
    it_cfg, it_seed, it_slot, it_kslot, context, nominal = [], [], [], [], [], []
    n_events = 0
    for c, policy in enumerate(policies):
        context.append(policy.score.compress_end(trace) if policy.score.evicts
                       else trace.prompt_length)
        nominal.append(policy.score.kept_tokens(policy.budget, context[-1])
                       if policy.score.evicts
                       else context[-1])
        seed_idx = range(len(seeds)) if policy.needs_seeds else range(1)
        per_seed_slot = policy.score.evicts and policy.score.seed_dependent
        slot_of_seed: dict[int, int] = {}
        for si in (seed_idx if per_seed_slot else [None]):
            pi, tau, bud = slot_events(trace, policy, None if si is None else int(seeds[si]),
                                        n_layers, query_positions)
            ev = event_of_queries(tau, query_positions)
            for e in range(tau.size):
                members = np.flatnonzero(ev == e)
                qlist.append(members)
                qptr.append(qptr[-1] + members.size)
            pis.append(pi)
            taus.append(tau)
            streams.append(np.array([step_stream(t) for t in tau], dtype=np.int64)
                           if policy.schedule.fresh else np.full(tau.size, -1, np.int64))
            budgets.append(bud)
            n_events += tau.size
            slot_of_seed[-1 if si is None else si] = len(slot_ev) - 1
            slot_ev.append(n_events)
        for si in seed_idx:
            slot = slot_of_seed[si if per_seed_slot else -1]
            kslot = -1
            if policy.design is not None and policy.design.variance == "fixed":
                kslot = len(kmasks)
                kmasks.append(fixed_kept(policy.design, pis[slot][0], uniforms[si]))
            it_cfg.append(c)
            it_seed.append(si)
            it_slot.append(slot)
            it_kslot.append(kslot)
    n_kv, P = trace.n_kv_heads, trace.n_positions
    i64 = np.int64
    return InclusionTables(
        pi=np.ascontiguousarray(np.concatenate(pis)), tau=np.concatenate(taus).astype(i64),
        ev_stream=np.concatenate(streams).astype(i64),
        ev_qptr=np.array(qptr, dtype=i64),
        ev_q=np.concatenate(qlist).astype(i64) if qlist else np.zeros(0, i64),
        slot_ev=np.array(slot_ev, dtype=i64), budget_tokens=np.concatenate(budgets),
        kmask=(np.stack(kmasks) if kmasks else np.zeros((0, n_kv, P), np.uint8)),
        it_cfg=np.array(it_cfg, dtype=i64), it_seed=np.array(it_seed, dtype=i64),
        it_slot=np.array(it_slot, dtype=i64), it_kslot=np.array(it_kslot, dtype=i64),
        context=np.array(context, dtype=i64), nominal=np.array(nominal, dtype=i64),
    )


def event_uniforms(tables: InclusionTables, event: int, seed: int, layer: int, kv_head: int,
                   uniforms: np.ndarray) -> np.ndarray:
    """The uniforms that decide the kept set of ``event`` for one seed and KV head, shape (P,).

    ``uniforms`` is that seed's and head's row of :func:`seed_uniforms` (stream 0); a fresh
    per-step event draws its own from stream ``tables.ev_stream[event]`` for the positions
    before the event (later positions are kept whatever the uniform: 0 there), as the compiled
    kernel does.
    """
    if int(tables.ev_stream[event]) < 0:
        return uniforms
    return fresh_uniforms(seed, layer, kv_head, uniforms.size, int(tables.tau[event]))


def fresh_uniforms(seed: int, layer: int, kv_head: int, n_positions: int,
                   step: int) -> np.ndarray:
    """Fresh per-step uniforms of the decode query at position ``step``, shape (P,): stream
    :func:`tracesim.prn.step_stream` for positions ``< step``, 0 from ``step`` on (kept)."""
    out = np.zeros(int(n_positions))
    t = min(int(step), out.size)
    out[:t] = permanent_uniforms(int(seed), int(layer), int(kv_head), np.arange(t),
                                 stream=step_stream(step))
    return out


def fixed_kept(design: Design, pi: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Kept mask (n_kv, P) of a fixed-size design: take-all plus the order sample of the tail."""
    kept = np.zeros(pi.shape, dtype=np.uint8)
    for g in range(pi.shape[0]):
        tail = np.flatnonzero((pi[g] > 0) & (pi[g] < 1))
        kept[g] = pi[g] >= 1
        if tail.size:
            kept[g, tail] = design.select(pi[g, tail], u[g, tail])
    return kept
