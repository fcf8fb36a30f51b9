"""Plain-numpy reference of the tiers simulator (:func:`simulate_layer_reference`).

It computes, per seed, decode step and KV head, full softmaxes, page sums and page bounds with
numpy, and is slow on long contexts; :func:`tracesim.tiers.simulate.simulate_layer` runs the
compiled kernel (:mod:`tracesim.kernels.tiers`) and the tests check that both agree on every
column. The model is described in :mod:`tracesim.tiers.simulate` and ``docs/tiers.md``.
"""

from __future__ import annotations

import numpy as np

from tracesim.bounds.pages import build_page_summaries, logit_upper_bounds
from tracesim.layer_trace import LayerTrace
from tracesim.policies import Policy
from tracesim.replay.kept import event_inclusion
from tracesim.tiers.model import MemoryModel
from tracesim.tiers.schedulers import (
    PageInputs,
    confidence_weights,
    get_scheduler,
    random_priority,
)
from tracesim.tiers.simulate import (
    SUMS,
    layer_memory_model,
    never_held,
    prepare_inputs,
    step_logprobs,
    to_columns,
    zero_sums,
)

__all__ = ["simulate_layer_reference"]


class _HeadPages:
    """The evicted pages of one KV head: summaries, positions and page boundaries."""

    def __init__(self, trace: LayerTrace, g: int, missing: np.ndarray, page: int,
                 token_bytes: int) -> None:
        self.summ = build_page_summaries(trace.keys[g], trace.values[g], missing, page)
        self.pos = np.flatnonzero(missing)
        pid = self.pos // page
        self.starts = np.flatnonzero(np.r_[True, pid[1:] != pid[:-1]]) if self.pos.size \
            else np.zeros(0, dtype=np.int64)
        self.page_id = self.summ.first // page
        self.bytes = self.summ.count.astype(np.float64) * token_bytes


def simulate_layer_reference(trace: LayerTrace, policy: Policy, seeds: np.ndarray,
                             n_layers: int, memory: MemoryModel, schedulers: tuple[str, ...],
                             budgets: np.ndarray) -> dict[str, np.ndarray]:
    """Simulate every scheduler and fetch budget on one layer of one sequence, in numpy.

    Same parameters and result as :func:`tracesim.tiers.simulate.simulate_layer`, which the
    tests compare with this on every column.
    """
    budgets, schedulers, seeds, qidx, qpos = prepare_inputs(trace, policy, seeds, schedulers,
                                                            budgets)
    H, G, n_kv = trace.n_heads, trace.group_size, trace.n_kv_heads
    d = trace.keys.shape[2]
    NQ, NS, NB = qidx.size, len(schedulers), budgets.size
    tb = memory.token_bytes(d)
    n_tiers = len(memory.lower)
    hajek = policy.correction == "hajek"
    conf_w = confidence_weights(step_logprobs(trace, qpos))
    layer_memory = layer_memory_model(memory, n_layers)
    table = {s: get_scheduler(s) for s in schedulers}
    need_bound = any(s.needs_bound for s in table.values())
    need_uniforms = any(s.needs_uniforms for s in table.values())

    sums = zero_sums(NS, NB, H, n_kv, NQ, n_tiers)
    err_before, cert, err_after, kv_bytes, kv_pages, evicted, fetch_s, stall_s, tier_bytes = (
        sums[k] for k in SUMS)

    sliding = trace.window is not None
    never = never_held(trace, qpos, memory.page)
    for seed in seeds:
        pi, kept = event_inclusion(trace, policy, int(seed), n_layers)
        heads = [_HeadPages(trace, g, ~(kept[g] | never), memory.page, tb) for g in range(n_kv)]
        all_bytes = np.concatenate([hp.bytes for hp in heads])
        tier = layer_memory.placement(all_bytes)
        offsets = np.cumsum([0] + [hp.bytes.size for hp in heads])
        for a, qi in enumerate(qidx):
            t = int(qpos[a])
            lo = int(trace.window_start(t))          # what a sliding layer holds: [lo, t]
            first_held = lo // memory.page * memory.page
            # the schedulers' inputs (PageInputs), page by page over the layer
            uniform_all, oracle_all = np.zeros(all_bytes.size), np.zeros(all_bytes.size)
            pc_all, b_all = np.zeros(all_bytes.size), np.zeros(all_bytes.size)
            head_cert, head_bound = np.zeros(all_bytes.size), np.zeros(all_bytes.size)
            head_pages = np.zeros(all_bytes.size, dtype=np.int64)
            base_num, base_den, page_num, page_den, truth = [], [], [], [], []
            kept_tokens = 0
            n_visible = []
            for g, hp in enumerate(heads):
                hs = slice(g * G, (g + 1) * G)
                K, V = trace.keys[g, :t + 1], trace.values[g, :t + 1]
                Q = trace.queries[hs, qi]                                  # (G, d)
                s = trace.logits(K @ Q.T)                                  # (t+1, G)
                s[:lo] = -np.inf
                smax = s.max(axis=0)
                zs = np.zeros(G)   # the sinks: take-all denominator terms with value zero
                if trace.sinks is not None:
                    smax = np.maximum(smax, trace.sinks[hs])
                    zs = np.exp(trace.sinks[hs] - smax)
                e = np.exp(s - smax)
                etot = e.sum(axis=0) + zs
                o = (e.T @ V) / etot[:, None]
                km = kept[g, :t + 1] & (np.arange(t + 1) >= lo)
                kept_tokens += int(km.sum())
                inv = np.where(km, 1.0 / np.where(km, pi[g, :t + 1], 1.0), 0.0) if hajek \
                    else km.astype(np.float64)
                w = e * inv[:, None]
                num, den = w.T @ V, w.sum(axis=0) + zs
                o_hat = num / den[:, None]
                err_before[hs, a] += ((o_hat - o) ** 2).sum(axis=1)
                tail = km & (pi[g, :t + 1] < 1.0)
                if policy.certified and tail.any():
                    aw = w[tail] / den                                     # (m, G)
                    dv = ((V[tail][:, None, :] - o_hat[None]) ** 2).sum(axis=2)
                    contrib = (1.0 - pi[g, :t + 1][tail])[:, None] * aw ** 2 * dv  # (m, G)
                    c2 = contrib.sum(axis=0)
                    cert[hs, a] += c2
                    tail_pos = np.flatnonzero(tail)
                else:
                    c2 = np.zeros(G)
                    contrib, tail_pos = np.zeros((0, G)), np.zeros(0, dtype=np.int64)
                # Page sums of the evicted tokens this query sees.
                vis = (hp.pos <= t) & (hp.pos >= first_held)
                nf = int(np.searchsorted(hp.page_id, lo // memory.page))   # freed pages
                if vis.all():
                    pos, starts, npg = hp.pos, hp.starts, hp.page_id.size
                else:
                    pos = hp.pos[vis]
                    pid = pos // memory.page
                    starts = np.flatnonzero(np.r_[True, pid[1:] != pid[:-1]]) if pos.size \
                        else np.zeros(0, dtype=np.int64)
                    npg = starts.size
                pn = np.zeros((hp.page_id.size, G, d))
                pd = np.zeros((hp.page_id.size, G))
                held = slice(nf, nf + npg)
                if pos.size:
                    em = e[pos]
                    pd[held] = np.add.reduceat(em, starts, axis=0)
                    pn[held] = np.add.reduceat(em[:, :, None] * V[pos][:, None, :], starts,
                                               axis=0)
                # A fetched page is then complete: its sampled tokens lose the 1/pi weight.
                adj = np.flatnonzero(tail & np.isin(np.arange(t + 1) // memory.page,
                                                    hp.page_id[held]))
                if adj.size and hajek:
                    ea = e[adj] * (1.0 - inv[adj])[:, None]            # (n_adj, G), <= 0
                    slot = np.searchsorted(hp.page_id, adj // memory.page)
                    np.add.at(pd, slot, ea)
                    np.add.at(pn, slot, ea[:, :, None] * V[adj][:, None, :])
                n_visible.append((nf, npg))
                base_num.append(num)
                base_den.append(den)
                page_num.append(pn)
                page_den.append(pd)
                truth.append(o)
                evicted[g, a] += hp.bytes[held].sum()
                sl = slice(offsets[g], offsets[g + 1])
                oracle_all[sl] = (pd / etot).sum(axis=1)
                bterm = np.zeros(hp.page_id.size)
                if need_bound:
                    eK = e[km]
                    E_R = eK.sum(axis=0) + zs
                    o_R = (eK.T @ V[km]) / E_R[:, None]
                    if hp.page_id.size:
                        for h in range(G):
                            u = logit_upper_bounds(Q[h], hp.summ, trace.scale)
                            if trace.softcap is not None:   # increasing: caps the bound
                                u = trace.softcap * np.tanh(u / trace.softcap)
                            u = u - smax[h]
                            dist = np.linalg.norm(hp.summ.vcen - o_R[h], axis=1) + hp.summ.vrad
                            bterm += hp.summ.count * np.exp(np.minimum(u, 700.0)) * dist / E_R[h]
                        bterm[nf + npg:] = 0.0
                        bterm[:nf] = 0.0
                # the page's share of the certificate: its sampled tokens' terms
                slot = np.searchsorted(hp.page_id, tail_pos // memory.page)
                ok = (slot < hp.page_id.size) & (hp.page_id[np.minimum(
                    slot, max(hp.page_id.size - 1, 0))] == tail_pos // memory.page) \
                    if hp.page_id.size else np.zeros(tail_pos.size, dtype=bool)
                pc = np.zeros(hp.page_id.size)
                np.add.at(pc, slot[ok], contrib.sum(axis=1)[ok])
                pc_all[sl], b_all[sl] = pc, bterm
                head_cert[sl], head_bound[sl] = c2.sum(), bterm.sum()
                head_pages[sl] = npg if sliding else bterm.size
                if need_uniforms:
                    uniform_all[sl] = random_priority(int(seed), trace.layer, g, a, hp.page_id)
            # layer totals: sequential sums, in the kernel's order
            ct = float(np.cumsum(pc_all)[-1]) if pc_all.size else 0.0
            bt = float(np.cumsum(b_all)[-1]) if b_all.size else 0.0
            inputs = PageInputs(uniform=uniform_all, bound=b_all, oracle_mass=oracle_all,
                                page_cert=pc_all, head_cert=head_cert, head_bound=head_bound,
                                head_pages=head_pages, layer_cert=ct, layer_bound=bt)
            prio = {name: s.reference(inputs) for name, s in table.items() if s.fetches}
            # Pages a query cannot see yet (none for decode steps of one-shot eviction) never go,
            # nor those a sliding layer has freed behind its window.
            visible = np.concatenate([(np.arange(hp.page_id.size) >= nf)
                                      & (np.arange(hp.page_id.size) < nf + nv)
                                      for hp, (nf, nv) in zip(heads, n_visible, strict=True)])
            total = all_bytes[visible].sum() if sliding else all_bytes.sum()
            for si, s_name in enumerate(schedulers):
                if not table[s_name].fetches:
                    order = np.zeros(0, dtype=np.int64)
                else:
                    cand = np.flatnonzero(visible)
                    order = cand[np.argsort(-prio[s_name][cand], kind="stable")]
                cum = np.cumsum(all_bytes[order])
                for bi, f in enumerate(budgets):
                    # f = 1 is unlimited: every evicted page, for every scheduler.
                    B = total if f >= 1.0 else min(
                        total, f * total * (conf_w[a] if table[s_name].scaled_budget else 1.0))
                    n_sel = int(np.searchsorted(cum, B * (1 + 1e-12), side="right"))
                    sel = order[:n_sel]
                    mask = np.zeros(all_bytes.size, dtype=bool)
                    mask[sel] = True
                    for g in range(n_kv):
                        hs = slice(g * G, (g + 1) * G)
                        msk = mask[offsets[g]:offsets[g + 1]]
                        held_pages = n_visible[g][1] if sliding else msk.size
                        if held_pages and msk.sum() == held_pages:
                            o_after = truth[g]     # nothing left out: the exact cache
                        else:
                            num = base_num[g] + page_num[g][msk].sum(axis=0)
                            den = base_den[g] + page_den[g][msk].sum(axis=0)
                            o_after = num / den[:, None]
                        err_after[si, bi, hs, a] += ((o_after - truth[g]) ** 2).sum(axis=1)
                        kv_bytes[si, bi, g, a] += all_bytes[offsets[g]:offsets[g + 1]][msk].sum()
                        kv_pages[si, bi, g, a] += msk.sum()
                    nf = np.bincount(tier[sel], minlength=n_tiers).astype(np.float64)
                    nb = np.bincount(tier[sel], weights=all_bytes[sel], minlength=n_tiers)
                    fetched_tokens = all_bytes[sel].sum() / tb
                    fs, st = layer_memory.step_times(nf[None], nb[None], np.array(
                        [(kept_tokens + fetched_tokens) * tb]))
                    fetch_s[si, bi, a] += fs[0]
                    stall_s[si, bi, a] += st[0]
                    tier_bytes[si, bi, a] += nb

    return to_columns(trace, policy, memory, schedulers, budgets, seeds.size, qpos, sums)
