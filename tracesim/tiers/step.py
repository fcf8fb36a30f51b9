"""One decode step of one layer, one scheduler: page priorities and the pages fetched.

The offline simulator (:mod:`tracesim.tiers.simulate`) evaluates every scheduler and budget at
once over a stored layer. The in-loop fetch (``tracesim evict --fetch``, :mod:`capture.fetch`)
needs the same decision one step at a time, inside the model, for the scheduler it enforces.
This module computes it with the simulator's rules and in the same float64 arithmetic, so that
on the same query, keys and values the two choose the same pages (a test checks it on layer 0,
whose inputs depend only on the tokens):

* pages: per KV head, the evicted positions grouped into pages of ``memory.page`` positions,
  summarised by :func:`tracesim.bounds.pages.build_page_summaries`; bytes ``2 d
  bytes_per_element`` per evicted token; placement in the lower tiers in (KV head, position)
  order with a 1 / n_layers share of each tier's capacity;
* priorities (:mod:`tracesim.tiers.schedulers`): ``random`` from the permanent uniforms of
  stream 2 keyed by (seed, layer, KV head, step, page); ``certificate`` and
  ``certificate_page`` from the sampled tail's certificate terms and the page bounds;
  ``bound`` from the page bounds; ``oracle`` from the true attention mass of the page (after the
  fetched page's sampled tokens lose their ``1/pi`` weight);
* selection: pages in decreasing priority (stable), whole, until the byte budget
  ``f x`` (the layer's evicted bytes) is spent; ``f >= 1`` fetches every page.

Only the page summaries of evicted tokens enter the deployable priorities (``bound``,
``certificate*``); the evicted keys themselves are read by ``oracle`` alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracesim.bounds.pages import PageSummaries, build_page_summaries, logit_upper_bounds
from tracesim.tiers.model import MemoryModel
from tracesim.tiers.schedulers import random_priority

__all__ = ["INLOOP_SCHEDULERS", "LayerPages", "StepFetch", "layer_memory", "layer_pages",
           "select_pages", "step_fetch", "step_priority"]

#: Schedulers the in-loop fetch enforces (``confidence`` needs the whole sequence's log-probs
#: to normalise its per-step budgets, which a decode loop does not have).
INLOOP_SCHEDULERS = ("none", "random", "certificate", "certificate_page", "bound", "oracle",
                     "certificate_bound")


def layer_memory(memory: MemoryModel, n_layers: int) -> MemoryModel:
    """The memory model of one layer: an equal 1 / n_layers share of every tier's capacity."""
    share = 1.0 / max(1, int(n_layers))
    return MemoryModel(
        hbm_bandwidth_gbps=memory.hbm_bandwidth_gbps, page=memory.page,
        bytes_per_element=memory.bytes_per_element, overlap=memory.overlap,
        lower=tuple(type(t)(t.name, t.bandwidth_gbps, t.latency_us, t.capacity_gb * share,
                            t.queue_depth) for t in memory.lower))


@dataclass(frozen=True)
class LayerPages:
    """The evicted pages of every KV head of one layer under a one-shot plan.

    Attributes
    ----------
    page : int
        Positions per page.
    summaries : list of PageSummaries
        Per KV head.
    positions : list of ndarray of int64
        Evicted positions per KV head (ascending).
    starts : list of ndarray of int64
        Index into ``positions`` of each page's first evicted token.
    page_ids : list of ndarray of int64
        Page index (position // page) of each KV head's non-empty pages.
    page_bytes : ndarray, shape (n_pages,)
        Bytes of every page, KV heads concatenated in order.
    offsets : ndarray of int64, shape (n_kv + 1,)
        KV head ``g``'s pages are ``page_bytes[offsets[g]:offsets[g + 1]]``.
    tier : ndarray of int64, shape (n_pages,)
        Lower tier holding each page.
    token_bytes : int
        Bytes of one token of one KV head (key and value).
    """

    page: int
    summaries: list[PageSummaries]
    positions: list[np.ndarray]
    starts: list[np.ndarray]
    page_ids: list[np.ndarray]
    page_bytes: np.ndarray
    offsets: np.ndarray
    tier: np.ndarray
    token_bytes: int


def layer_pages(keys: np.ndarray, values: np.ndarray, kept: np.ndarray,
                memory: MemoryModel) -> LayerPages:
    """Pages of the tokens a plan evicts.

    Parameters
    ----------
    keys, values : ndarray, shape (n_kv, N, d)
        Post-RoPE keys and values of at least every evicted position.
    kept : ndarray of bool, shape (n_kv, N)
    memory : MemoryModel
        The *layer's* model (:func:`layer_memory`): page size, bytes per element, capacities.
    """
    keys = np.asarray(keys, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    page = memory.page
    tb = memory.token_bytes(keys.shape[2])
    summ, pos, starts, pids, nbytes = [], [], [], [], []
    for g in range(keys.shape[0]):
        s = build_page_summaries(keys[g], values[g], ~np.asarray(kept[g], bool), page)
        p = np.flatnonzero(~np.asarray(kept[g], bool))
        pid = p // page
        st = (np.flatnonzero(np.r_[True, pid[1:] != pid[:-1]]) if p.size
              else np.zeros(0, dtype=np.int64))
        summ.append(s)
        pos.append(p)
        starts.append(st)
        pids.append(s.first // page)
        nbytes.append(s.count.astype(np.float64) * tb)
    page_bytes = np.concatenate(nbytes)
    offsets = np.cumsum([0] + [b.size for b in nbytes]).astype(np.int64)
    return LayerPages(page, summ, pos, starts, pids, page_bytes, offsets,
                      memory.placement(page_bytes), tb)


def step_priority(pages: LayerPages, scheduler: str, query: np.ndarray, keys: np.ndarray,
                  values: np.ndarray, pi: np.ndarray, kept: np.ndarray, scale: float, *,
                  hajek: bool, certified: bool, seed: int, layer: int, step: int) -> np.ndarray:
    """Priority of every evicted page of the layer at one decode step (higher goes first).

    Parameters
    ----------
    pages : LayerPages
    scheduler : str
        One of :data:`INLOOP_SCHEDULERS` other than ``none``.
    query : ndarray, shape (H, d)
        The step's query of every query head.
    keys, values : ndarray, shape (n_kv, T, d)
        The cache the query sees (positions ``0..T-1``; the query is at ``T - 1``).
    pi : ndarray, shape (n_kv, T)
        Inclusion probabilities (1 for take-all and generated tokens).
    kept : ndarray of bool, shape (n_kv, T)
    scale : float
        Softmax scale.
    hajek, certified : bool
        The base policy's correction and whether it carries certificates.
    seed, layer, step : int
        Keys of the permanent uniforms of ``random`` (``step`` counts decode steps from 0).

    Returns
    -------
    ndarray, shape (n_pages,)
    """
    n_kv, T, _ = keys.shape
    G = query.shape[0] // n_kv
    page = pages.page
    prio = np.zeros(pages.page_bytes.size)
    pc_all, b_all = np.zeros(prio.size), np.zeros(prio.size)
    for g in range(n_kv):
        sl = slice(pages.offsets[g], pages.offsets[g + 1])
        pid = pages.page_ids[g]
        if scheduler == "random":
            prio[sl] = random_priority(int(seed), int(layer), g, int(step), pid)
            continue
        Q = query[g * G:(g + 1) * G]
        K, V = keys[g], values[g]
        s = (K @ Q.T) * scale                                          # (T, G)
        smax = s.max(axis=0)
        e = np.exp(s - smax)
        km = kept[g]
        inv = np.where(km, 1.0 / np.where(km, pi[g], 1.0), 0.0) if hajek \
            else km.astype(np.float64)
        if scheduler == "oracle":
            pos, starts = pages.positions[g], pages.starts[g]
            pd = np.zeros((pid.size, G))
            if pos.size:
                pd[:] = np.add.reduceat(e[pos], starts, axis=0)
            # A fetched page is complete: its sampled tokens lose the 1/pi weight.
            tail = km & (pi[g] < 1.0)
            adj = np.flatnonzero(tail & np.isin(np.arange(T) // page, pid))
            if adj.size and hajek:
                ea = e[adj] * (1.0 - inv[adj])[:, None]
                np.add.at(pd, np.searchsorted(pid, adj // page), ea)
            prio[sl] = (pd / e.sum(axis=0)).sum(axis=1)
            continue
        w = e * inv[:, None]
        den = w.sum(axis=0)
        o_hat = (w.T @ V) / den[:, None]
        tail = km & (pi[g] < 1.0)
        if certified and tail.any():
            aw = w[tail] / den
            dv = ((V[tail][:, None, :] - o_hat[None]) ** 2).sum(axis=2)
            contrib = (1.0 - pi[g][tail])[:, None] * aw ** 2 * dv        # (m, G)
            c2 = contrib.sum(axis=0)
            tail_pos = np.flatnonzero(tail)
        else:
            c2 = np.zeros(G)
            contrib, tail_pos = np.zeros((0, G)), np.zeros(0, dtype=np.int64)
        eK = e[km]
        E_R = eK.sum(axis=0)
        o_R = (eK.T @ V[km]) / E_R[:, None]
        summ = pages.summaries[g]
        bterm = np.zeros(pid.size)
        for h in range(G if pid.size else 0):
            u = logit_upper_bounds(Q[h], summ, scale) - smax[h]
            dist = np.linalg.norm(summ.vcen - o_R[h], axis=1) + summ.vrad
            bterm += summ.count * np.exp(np.minimum(u, 700.0)) * dist / E_R[h]
        tot = bterm.sum()
        if scheduler == "bound":
            prio[sl] = bterm
        elif scheduler == "certificate":
            frac = bterm / tot if tot > 0 else np.full(bterm.size, 1.0 / max(1, bterm.size))
            prio[sl] = c2.sum() * frac
        elif scheduler in ("certificate_page", "certificate_bound"):
            tp = tail_pos // page
            slot = np.searchsorted(pid, tp)
            ok = ((slot < pid.size) & (pid[np.minimum(slot, max(pid.size - 1, 0))] == tp)
                  if pid.size else np.zeros(tail_pos.size, dtype=bool))
            pc = np.zeros(pid.size)
            np.add.at(pc, slot[ok], contrib.sum(axis=1)[ok])
            frac = bterm / tot if tot > 0 else np.zeros(bterm.size)
            prio[sl] = pc + 1e-9 * c2.sum() * frac
            pc_all[sl], b_all[sl] = pc, bterm
        else:
            raise ValueError(f"scheduler {scheduler!r}: expected one of {INLOOP_SCHEDULERS}")
    if scheduler == "certificate_bound":
        # the page's share of the layer's certificate plus its share of the layer's page bound
        # (sequential sums, in the offline kernel's order)
        ct = float(np.cumsum(pc_all)[-1]) if pc_all.size else 0.0
        bt = float(np.cumsum(b_all)[-1]) if b_all.size else 0.0
        prio = (pc_all / ct if ct > 0 else 0.0 * pc_all) + (b_all / bt if bt > 0 else 0.0 * b_all)
    return prio


def select_pages(priority: np.ndarray, page_bytes: np.ndarray, budget: float) -> np.ndarray:
    """Pages fetched within ``budget`` (a fraction of ``page_bytes.sum()``), in fetch order.

    Pages go in decreasing priority (stable: ties keep page order), whole, stopping at the
    first that no longer fits; ``budget >= 1`` fetches every page.
    """
    total = page_bytes.sum()
    order = np.argsort(-priority, kind="stable")
    cum = np.cumsum(page_bytes[order])
    B = total if budget >= 1.0 else min(total, budget * total)
    return order[:int(np.searchsorted(cum, B * (1 + 1e-12), side="right"))]


@dataclass(frozen=True)
class StepFetch:
    """The fetches of one (decode step, layer).

    Attributes
    ----------
    pages : list of ndarray of int64
        Page indices (position // page) fetched per KV head.
    bytes_moved, pages_fetched : float
        Bytes and pages fetched by the layer at this step.
    evicted_bytes : float
        Bytes of every evicted page of the layer (what refetching all would move).
    fetch_s, stall_s : float
        Modelled fetch time and stall (seconds), :meth:`MemoryModel.step_times`.
    tier_bytes : ndarray, shape (n_tiers,)
        Bytes fetched from each lower tier.
    """

    pages: list[np.ndarray]
    bytes_moved: float
    pages_fetched: float
    evicted_bytes: float
    fetch_s: float
    stall_s: float
    tier_bytes: np.ndarray


def step_fetch(pages: LayerPages, memory: MemoryModel, scheduler: str, budget: float,
               query: np.ndarray, keys: np.ndarray, values: np.ndarray, pi: np.ndarray,
               kept: np.ndarray, scale: float, *, hajek: bool, certified: bool, seed: int,
               layer: int, step: int) -> StepFetch:
    """Choose one step's pages (:func:`step_priority`, :func:`select_pages`) and account for
    them with the layer's memory model (arguments as in :func:`step_priority`; ``memory`` is
    the layer's model, :func:`layer_memory`)."""
    n_tiers = len(memory.lower)
    if scheduler == "none" or pages.page_bytes.size == 0:
        sel = np.zeros(0, dtype=np.int64)
    else:
        prio = step_priority(pages, scheduler, query, keys, values, pi, kept, scale,
                             hajek=hajek, certified=certified, seed=seed, layer=layer, step=step)
        sel = select_pages(prio, pages.page_bytes, budget)
    per_head = []
    for g in range(len(pages.page_ids)):
        a, b = pages.offsets[g], pages.offsets[g + 1]
        mine = np.sort(sel[(sel >= a) & (sel < b)]) - a
        per_head.append(pages.page_ids[g][mine])
    nf = np.bincount(pages.tier[sel], minlength=n_tiers).astype(np.float64)
    nb = np.bincount(pages.tier[sel], weights=pages.page_bytes[sel], minlength=n_tiers)
    moved = float(pages.page_bytes[sel].sum())
    kept_tokens = float(np.asarray(kept).sum())
    fs, st = memory.step_times(nf[None], nb[None], np.array(
        [(kept_tokens + moved / pages.token_bytes) * pages.token_bytes]))
    return StepFetch(per_head, moved, float(sel.size), float(pages.page_bytes.sum()),
                     float(fs[0]), float(st[0]), nb)
