"""From policies to inclusion tables: scores -> budgets -> designs -> schedules, per layer.

Everything here is cheap (O(P log P) per KV head, event and slot) and runs in Python, except
a per-step design's many rows (a score and a head's probabilities at every decode step), which
are computed a block of steps at a time in compiled code (:meth:`Score.step_scores`,
:class:`~tracesim.replay.head_rows.StepRows`); the compiled kernel then replays every (policy,
seed) against these tables. A *slot* is one set of inclusion probabilities: one per policy,
or one per (policy, seed) when the score itself is random (``random``, ``keyformer``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracesim.designs import Design
from tracesim.designs.poisson import PoissonPPS
from tracesim.layer_trace import LayerTrace
from tracesim.policies import Policy
from tracesim.prn import permanent_uniforms, step_stream, uniform_grid
from tracesim.replay.head_rows import STEP_ROW_ENTRIES, StepRows, head_inclusion
from tracesim.schedules import event_of_queries, nested_inclusion

__all__ = ["InclusionTables", "build_inclusion", "event_uniforms", "fixed_kept", "fresh_uniforms",
           "head_inclusion", "seed_uniforms", "slot_events"]


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
    # Rows that need no earlier event (a per-step design: nothing is gone for good) under
    # Poisson capped PPS are computed together, compiled and in parallel (StepRows).
    rows = StepRows(raw, policy.design, score.top_fraction) \
        if per_step and isinstance(policy.design, PoissonPPS) else None
    event_scores = _event_scores(trace, score, tau, seed if score.seed_dependent else None,
                                 per_step)
    for e, t in enumerate(tau):
        t = int(t)
        # Positions the query at t attends on a sliding layer: (t - w, t]; None: every one.
        window = None if trace.window is None else np.arange(t) > t - trace.window
        xs, masks, tails = [], [], []
        for g, x in enumerate(next(event_scores)):
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
            budgets[e, g] = int(masks[g].sum()) + int(alloc[g])
            if rows is not None:
                first_alive = 0 if window is None else max(0, t - trace.window + 1)
                rows.add(e, g, xs[g], masks[g], first_alive, int(alloc[g]))
                continue
            alive = _alive(raw, e, g, t, deterministic, window)
            raw[e, g, :t] = head_inclusion(xs[g], masks[g], policy.design, int(alloc[g]),
                                           score.top_fraction, alive, score.ties)
    if rows is not None:
        rows.flush()
    return (raw if per_step else nested_inclusion(raw)), tau, budgets


def _event_scores(trace: LayerTrace, score, tau: np.ndarray, seed: int | None,
                  per_step: bool):
    """Every KV head's scores at each event of ``tau``, one list per event (a generator).

    A per-step score computes a block of steps per KV head at once
    (:meth:`~tracesim.policies.base.Score.step_scores`), blocks of at most
    :data:`STEP_ROW_ENTRIES` positions of the group's heads; other scores one event at a time.
    """
    n_kv = trace.n_kv_heads
    if not per_step:
        for t in tau:
            yield [score.scores(trace, g, int(t), seed) for g in range(n_kv)]
        return
    width = trace.group_size * (int(tau.max()) + 1) if tau.size else 1
    block = max(1, STEP_ROW_ENTRIES // width)
    for b0 in range(0, tau.size, block):
        ends = tau[b0:b0 + block]
        per_head = [score.step_scores(trace, g, ends, seed) for g in range(n_kv)]
        for i in range(ends.size):
            yield [per_head[g][i] for g in range(n_kv)]


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
