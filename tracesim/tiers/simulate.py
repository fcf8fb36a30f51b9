"""Offline simulation of certificate-scheduled fetches from lower memory tiers, one layer at a time.

For one layer of one sequence, a base eviction policy (one-shot, as in ``tracesim replay``)
decides which prompt tokens stay in HBM; the others live in pages of ``memory.page`` positions
per KV head in the lower tiers. At every evaluated decode step, each scheduler ranks the evicted
pages of all KV heads of the layer (:mod:`tracesim.tiers.schedulers`) and fetches them in that
order until the step's byte budget, a fraction ``f`` of the layer's evicted bytes, is spent. A
fetched page's tokens join the kept set for that step with ``pi = 1`` (they are all there now),
so with ``f = 1`` every estimate equals the full-cache output and with ``f = 0`` it is the plain
eviction estimate. Pages are fetched whole or not at all (in priority order, stopping at the
first page that no longer fits).

Per (head, step, scheduler, budget) the simulator reports the squared error before and after the
fetches, the bytes moved (the KV head's fetched bytes, and the row's share of them), the pages
fetched, and the modelled fetch time and stall of the layer at that step
(:class:`tracesim.tiers.model.MemoryModel`). Seeds of a randomized base policy are averaged.

:func:`simulate_layer` runs the compiled kernel :mod:`tracesim.kernels.tiers` (decode steps in
parallel; identical results for any number of threads);
:func:`tracesim.tiers.reference.simulate_layer_reference` is the plain-numpy reference it is
tested against.
"""

from __future__ import annotations

import numpy as np

from tracesim.kernels.bounds import build_pages
from tracesim.kernels.replay_events import check_logit_span
from tracesim.kernels.tiers import Attention, Inclusion, Pages, tiers_layer
from tracesim.layer_trace import LayerTrace
from tracesim.policies import Policy
from tracesim.prn import permanent_uniforms
from tracesim.replay.engine import evaluated_queries
from tracesim.replay.kept import event_inclusion
from tracesim.tiers.model import MemoryModel
from tracesim.tiers.schedulers import (
    STREAM_FETCH,
    confidence_weights,
    get_scheduler,
    kernel_schedule,
    scheduler_names,
)

__all__ = ["check_inputs", "kernel_pages", "layer_memory_model", "never_held", "prepare_inputs",
           "modelled_times", "random_priorities", "simulate_layer", "tail_positions",
           "step_logprobs", "SUMS", "to_columns", "zero_sums"]


def step_logprobs(trace: LayerTrace, positions: np.ndarray) -> np.ndarray:
    """Log-prob of the token each decode step reads (the one generated just before it).

    The query at position ``p >= prompt_length`` reads generated token ``p - prompt_length``;
    NaN where the manifest holds no log-prob for it.
    """
    lp = trace.meta.get("generated_logprobs")
    lp = np.asarray([] if lp is None else lp, dtype=np.float64)
    i = np.asarray(positions, dtype=np.int64) - int(trace.prompt_length)
    out = np.full(i.size, np.nan)
    ok = (i >= 0) & (i < lp.size)
    out[ok] = lp[i[ok]]
    return out


def check_inputs(trace: LayerTrace, policy: Policy, schedulers: tuple[str, ...],
                 budgets: np.ndarray) -> None:
    """Raise ``ValueError`` naming the field for anything the simulator cannot run."""
    known = scheduler_names()
    bad = [s for s in schedulers if s not in known]
    if bad:
        raise ValueError(f"schedulers: unknown {bad}; expected some of {list(known)}")
    if not schedulers:
        raise ValueError("schedulers: at least one is required")
    if budgets.size == 0 or np.any(~np.isfinite(budgets)) or np.any(budgets < 0) \
            or np.any(budgets > 1):
        raise ValueError(f"fetch_budgets = {budgets.tolist()}: expected fractions in [0, 1] of "
                         "the layer's evicted bytes")
    if not policy.score.evicts:
        raise ValueError("policy: the full cache evicts nothing; give an evicting policy")
    if policy.schedule.kind != "oneshot":
        raise ValueError(f"policy {policy.id}: tiers simulates one-shot eviction only "
                         "(schedule: oneshot)")
    certified = sorted({s for s in schedulers if get_scheduler(s).needs_certificate})
    if certified and not policy.certified:
        raise ValueError(f"schedulers {certified} need a "
                         f"certified base policy (randomized design with the Hájek correction); "
                         f"{policy.id} is not")
    if not any(r == "decode" for r in trace.query_roles):
        raise ValueError(f"sequence {trace.sequence_id!r} stores no decode query: tiers "
                         "simulates decode steps")


def layer_memory_model(memory: MemoryModel, n_layers: int) -> MemoryModel:
    """The memory model of one layer: an equal share (1 / n_layers) of every tier's capacity."""
    share = 1.0 / max(1, n_layers)
    return MemoryModel(
        hbm_bandwidth_gbps=memory.hbm_bandwidth_gbps, page=memory.page,
        bytes_per_element=memory.bytes_per_element, overlap=memory.overlap,
        lower=tuple(type(t)(t.name, t.bandwidth_gbps, t.latency_us, t.capacity_gb * share,
                            t.queue_depth) for t in memory.lower))


def kernel_pages(keys: np.ndarray, values: np.ndarray, kept: np.ndarray, page: int,
                 token_bytes: int, layer_memory: MemoryModel) -> Pages:
    """The evicted pages of every KV head with the block -> page map, as
    :func:`tracesim.kernels.tiers.tiers_layer` takes them; the summaries are those of
    :func:`tracesim.bounds.pages.build_page_summaries`, computed by the bound kernel.

    ``keys``, ``values`` (n_kv, N, d) float64 and ``kept`` (n_kv, N) cover at least every
    evicted position; ``layer_memory`` places the pages (:func:`layer_memory_model`)."""
    n_kv, N, d = keys.shape
    nb_max = -(-N // page)
    kmin, kmax, vcen = (np.empty((n_kv, nb_max, d)) for _ in range(3))
    vrad = np.empty((n_kv, nb_max))
    count, first, last = (np.empty((n_kv, nb_max), dtype=np.int64) for _ in range(3))
    sizes = [build_pages(np.ascontiguousarray(keys[g]), np.ascontiguousarray(values[g]),
                         np.ascontiguousarray(kept[g]), N - 1, page, kmin[g], kmax[g], vcen[g],
                         vrad[g], count[g], first[g], last[g]) for g in range(n_kv)]
    off = np.cumsum([0] + sizes).astype(np.int64)
    block_slot = np.full((n_kv, nb_max), -1, dtype=np.int64)
    for g, m in enumerate(sizes):
        block_slot[g, first[g, :m] // page] = np.arange(m)

    def cat(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.concatenate([x[g, :m] for g, m in enumerate(sizes)]))

    nbytes = cat(count).astype(np.float64) * token_bytes
    return Pages(off=off, first=cat(first), count=cat(count), kmin=cat(kmin), kmax=cat(kmax),
                 vcen=cat(vcen), vrad=cat(vrad), nbytes=nbytes,
                 tier=layer_memory.placement(nbytes), block_slot=block_slot, page=int(page))


def never_held(trace: LayerTrace, qpos: np.ndarray, page: int) -> np.ndarray:
    """Positions no decode step's lower tiers hold (bool, (N,)): on a sliding layer the pages
    wholly behind the first evaluated step's window, freed at eviction (``docs/tiers.md``,
    "Attention variants"); none on a full layer."""
    never = np.zeros(trace.n_positions, dtype=bool)
    if trace.window is not None and qpos.size:
        never[:int(trace.window_start(int(qpos.min()))) // page * page] = True
    return never


def random_priorities(seed: int, layer: int, pages: Pages, steps: np.ndarray) -> np.ndarray:
    """:func:`tracesim.tiers.schedulers.random_priority` of every page at each of ``steps``
    (decode step indices), shape (len(steps), NP)."""
    off = pages.off
    steps = np.asarray(steps, dtype=np.int64)[:, None]
    out = np.empty((steps.shape[0], off[-1]))
    for g in range(off.size - 1):
        pid = pages.first[off[g]:off[g + 1]] // pages.page
        key = (steps * 65537 + pid[None, :]) % (1 << 32)
        out[:, off[g]:off[g + 1]] = permanent_uniforms(
            int(seed), int(layer), g, key.ravel(), stream=STREAM_FETCH).reshape(key.shape)
    return out


def tail_positions(pi: np.ndarray, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sampled kept positions (``pi < 1``) of every KV head, ascending, as the kernel takes
    them: ``tail_pos[tail_off[g]:tail_off[g + 1]]``."""
    tails = [np.flatnonzero(kept[g] & (pi[g] < 1.0)) for g in range(kept.shape[0])]
    tail_off = np.cumsum([0] + [x.size for x in tails]).astype(np.int64)
    return tail_off, np.concatenate(tails).astype(np.int64)


def prepare_inputs(trace: LayerTrace, policy: Policy, seeds: np.ndarray,
                   schedulers: tuple[str, ...], budgets: np.ndarray
                   ) -> tuple[np.ndarray, tuple[str, ...], np.ndarray, np.ndarray, np.ndarray]:
    """Checked ``(budgets, schedulers, seeds, query indices, query positions)`` of one layer:
    the seeds the policy uses (the first only for a deterministic one) and its decode queries."""
    budgets = np.asarray(budgets, dtype=np.float64)
    schedulers = tuple(schedulers)
    check_inputs(trace, policy, schedulers, budgets)
    seeds = np.asarray(seeds, dtype=np.int64)
    if not policy.needs_seeds:
        seeds = seeds[:1]
    qidx = evaluated_queries(trace, ("decode",))
    return budgets, schedulers, seeds, qidx, trace.query_positions[qidx].astype(np.int64)


def simulate_layer(trace: LayerTrace, policy: Policy, seeds: np.ndarray, n_layers: int,
                   memory: MemoryModel, schedulers: tuple[str, ...],
                   budgets: np.ndarray) -> dict[str, np.ndarray]:
    """Simulate every scheduler and fetch budget on one layer of one sequence.

    Parameters
    ----------
    trace : LayerTrace
        The layer (float64), with decode queries.
    policy : Policy
        One-shot base eviction policy.
    seeds : ndarray of int, shape (S,)
        Seeds of the permanent random numbers (deterministic policies use the first only).
    n_layers : int
        Layers of the model (for the policy's budget schedule).
    memory : MemoryModel
    schedulers : tuple of str
        Names from :func:`tracesim.tiers.schedulers.scheduler_names` (the built-ins and the
        registered ones).
    budgets : ndarray, shape (B,)
        Fetch budgets as fractions of the layer's evicted bytes at the step.

    Returns
    -------
    dict of str -> ndarray
        Columns of length ``len(schedulers) * B * n_heads * n_steps`` in that nesting order
        (scheduler outermost, step innermost); see ``docs/tiers.md``.
    """
    budgets, schedulers, seeds, qidx, qpos = prepare_inputs(trace, policy, seeds, schedulers,
                                                            budgets)
    H, n_kv = trace.n_heads, trace.n_kv_heads
    NQ, NS, NB = qidx.size, len(schedulers), budgets.size
    tb = memory.token_bytes(trace.keys.shape[2])
    n_tiers = len(memory.lower)
    conf_w = confidence_weights(step_logprobs(trace, qpos))
    layer_memory = layer_memory_model(memory, n_layers)
    need_uniforms = any(get_scheduler(s).needs_uniforms for s in schedulers)
    K = np.ascontiguousarray(trace.keys, dtype=np.float64)
    V = np.ascontiguousarray(trace.values, dtype=np.float64)
    Q = np.ascontiguousarray(trace.queries[:, qidx], dtype=np.float64)
    # the kernel divides by kept-set normalisers: refuse logits beyond exp's range first
    check_logit_span(K, Q, qpos, float(trace.scale), H // n_kv,
                     f"sequence {trace.sequence_id!r} layer {trace.layer}")

    sums = zero_sums(NS, NB, H, n_kv, NQ, n_tiers)
    for seed in seeds:
        pi, kept = event_inclusion(trace, policy, int(seed), n_layers)
        pi = np.ascontiguousarray(pi, dtype=np.float64)
        kept = np.ascontiguousarray(kept, dtype=np.bool_)
        pages = kernel_pages(trace.keys, trace.values, kept | never_held(trace, qpos, memory.page),
                             memory.page, tb, layer_memory)
        tail_off, tail_pos = tail_positions(pi, kept)
        rprio = (random_priorities(int(seed), trace.layer, pages, np.arange(NQ))
                 if need_uniforms else np.zeros((1, 1)))
        sched, plugin = kernel_schedule(schedulers, budgets, conf_w, rprio)
        r = tiers_layer(Attention(K, V, Q, qpos, trace.scale, trace.softcap or 0.0,
                                  trace.window or 0, trace.sinks),
                        Inclusion(pi, kept, policy.correction == "hajek", bool(policy.certified),
                                  tail_off, tail_pos),
                        pages, sched, n_tiers, plugin=plugin)
        for k in ("err_before", "cert", "err_after", "kv_bytes", "kv_pages", "evicted"):
            sums[k] += r[k]
        sums["tier_bytes"] += r["tier_nb"]
        fs, st = modelled_times(layer_memory, r["tier_nf"], r["tier_nb"],
                                r["kept_tokens"][None, None, :], tb)
        sums["fetch_s"] += fs
        sums["stall_s"] += st
    return to_columns(trace, policy, memory, schedulers, budgets, seeds.size, qpos, sums)


#: The per-layer sums over seeds that :func:`to_columns` reads, in :func:`zero_sums` order.
SUMS = ("err_before", "cert", "err_after", "kv_bytes", "kv_pages", "evicted", "fetch_s",
        "stall_s", "tier_bytes")


def zero_sums(NS: int, NB: int, H: int, n_kv: int, NQ: int,
              n_tiers: int) -> dict[str, np.ndarray]:
    """The :data:`SUMS` of one layer, zeroed (shapes as :func:`to_columns` documents)."""
    shapes = ((H, NQ), (H, NQ), (NS, NB, H, NQ), (NS, NB, n_kv, NQ), (NS, NB, n_kv, NQ),
              (n_kv, NQ), (NS, NB, NQ), (NS, NB, NQ), (NS, NB, NQ, n_tiers))
    return {k: np.zeros(shape) for k, shape in zip(SUMS, shapes, strict=True)}


def modelled_times(layer_memory: MemoryModel, tier_nf: np.ndarray, tier_nb: np.ndarray,
                   kept_tokens: np.ndarray, token_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Modelled fetch time and stall (seconds) of steps, from their fetches and bytes per lower
    tier ``(..., n_tiers)`` and their kept tokens (broadcast to ``tier_nf.shape[:-1]``): the
    step reads its kept tokens and the fetched ones."""
    n_tiers = tier_nf.shape[-1]
    kept_bytes = (kept_tokens + tier_nb.sum(axis=-1) / token_bytes) * token_bytes
    fs, st = layer_memory.step_times(tier_nf.reshape(-1, n_tiers),
                                     tier_nb.reshape(-1, n_tiers), kept_bytes.ravel())
    return fs.reshape(kept_bytes.shape), st.reshape(kept_bytes.shape)


def to_columns(trace: LayerTrace, policy: Policy, memory: MemoryModel,
               schedulers: tuple[str, ...], budgets: np.ndarray, n_seeds: int,
               qpos: np.ndarray, sums: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Output columns from the sums over seeds (:func:`zero_sums`):

    ``err_before``, ``cert`` (H, NQ); ``err_after`` (NS, NB, H, NQ); ``kv_bytes``, ``kv_pages``
    (NS, NB, n_kv, NQ); ``evicted`` (n_kv, NQ); ``fetch_s``, ``stall_s`` (NS, NB, NQ), seconds;
    ``tier_bytes`` (NS, NB, NQ, n_tiers). Every value is divided by ``n_seeds``.
    """
    H, G = trace.n_heads, trace.group_size
    NS, NB, NQ = len(schedulers), budgets.size, qpos.size
    err_before, cert, err_after, kv_bytes, kv_pages, evicted, fetch_s, stall_s, tier_bytes = (
        sums[k] for k in SUMS)
    n = float(n_seeds)
    shape = (NS, NB, H, NQ)
    head = np.broadcast_to(np.arange(H)[None, None, :, None], shape)
    kvh = head // G
    step = np.broadcast_to(np.arange(NQ)[None, None, None, :], shape)
    sched = np.broadcast_to(np.arange(NS)[:, None, None, None], shape)
    bud = np.broadcast_to(np.arange(NB)[None, :, None, None], shape)
    kvb = np.take_along_axis(kv_bytes, np.broadcast_to(
        (np.arange(H) // G)[None, None, :, None], (NS, NB, H, NQ)), axis=2)
    kvp = np.take_along_axis(kv_pages, np.broadcast_to(
        (np.arange(H) // G)[None, None, :, None], (NS, NB, H, NQ)), axis=2)
    ev = evicted[(np.arange(H) // G)][None, None]
    cols: dict[str, np.ndarray] = {
        "head": head.ravel().astype(np.int32),
        "kv_head": kvh.ravel().astype(np.int32),
        "step": step.ravel().astype(np.int32),
        "query_position": qpos[step.ravel()].astype(np.int32),
        "scheduler": np.asarray(schedulers, dtype=object)[sched.ravel()],
        "fetch_budget": budgets[bud.ravel()],
        "n_seeds": np.full(head.size, n_seeds, dtype=np.int32),
        "err2_before": np.broadcast_to(err_before[None, None] / n, shape).ravel(),
        "err2_after": (err_after / n).ravel(),
        "cert2": (np.broadcast_to(cert[None, None] / n, shape).ravel() if policy.certified
                  else np.full(head.size, np.nan)),
        "kv_bytes_moved": (kvb / n).ravel(),
        "bytes_moved": (kvb / n / G).ravel(),
        "pages_fetched": (kvp / n).ravel(),
        "evicted_bytes": np.broadcast_to(ev / n, shape).ravel(),
        "fetch_ms": np.broadcast_to((fetch_s / n * 1e3)[:, :, None, :], shape).ravel(),
        "stall_ms": np.broadcast_to((stall_s / n * 1e3)[:, :, None, :], shape).ravel(),
    }
    for i, t in enumerate(memory.lower):
        cols[f"bytes_{t.name}"] = np.broadcast_to(
            (tier_bytes[..., i] / n)[:, :, None, :], shape).ravel()
    return cols
