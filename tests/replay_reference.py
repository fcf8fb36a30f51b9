"""A slow, plain-numpy reference replay, written from the textbook formulas.

It shares only the inclusion tables (pi, events, fixed-size kept sets) with the engine; every
estimate, certificate, coverage event and diagnostic is recomputed here per (iteration, head,
query) with explicit loops, the formulas of ``tests/reference.py`` and scipy quantiles.
"""

from __future__ import annotations

import numpy as np
from scipy import stats

from tests.reference import full_attention_reference, hajek_reference, output_space_reference
from tracesim.kernels import replay as K
from tracesim.replay.engine import evaluated_queries
from tracesim.replay.inclusion import InclusionTables, event_uniforms, seed_uniforms


def reference_replay(trace, policies, seeds, tables: InclusionTables, alpha: float = 0.05):
    """Return (out, lout) shaped like the engine's, NaN where a field is not defined."""
    qidx = evaluated_queries(trace)
    qpos = trace.query_positions[qidx]
    H, G, d = trace.n_heads, trace.group_size, trace.keys.shape[2]
    P = trace.n_positions
    u = seed_uniforms(np.asarray(seeds), trace.layer, trace.n_kv_heads, P)
    n_it = tables.it_cfg.size
    out = np.full((n_it, H, qidx.size, K.N_FIELDS), np.nan)
    lout = np.full((n_it, qidx.size, K.N_LAYER_FIELDS), np.nan)
    z = stats.norm.ppf(1 - alpha / 2)
    W = trace.o_proj
    for it in range(n_it):
        policy = policies[tables.it_cfg[it]]
        slot, s, ks = tables.it_slot[it], tables.it_seed[it], tables.it_kslot[it]
        qev = tables.query_event(slot)
        ests = np.zeros((H, qidx.size, d))
        truths = np.zeros((H, qidx.size, d))
        for a, (qi, t) in enumerate(zip(qidx, qpos, strict=True)):
            e = qev[a]
            pi = tables.pi[e]
            # fresh per-step events draw their own uniforms (stream 2**31 + step)
            u_e = np.stack([event_uniforms(tables, e, int(seeds[s]), trace.layer, g, u[s, g])
                            for g in range(trace.n_kv_heads)])
            kept = (tables.kmask[ks] > 0) if ks >= 0 else (u_e < pi)
            vis = slice(0, t + 1)
            for h in range(H):
                g = h // G
                keys, vals = trace.keys[g, vis], trace.values[g, vis]
                p_h, k_h = pi[g, vis], kept[g, vis]
                q = trace.queries[h, qi]
                truth = full_attention_reference(q, keys, vals, trace.scale)
                fixed = policy.design is not None and policy.design.variance == "fixed"
                est, V, m = hajek_reference(q, keys, vals, p_h, k_h, trace.scale,
                                            correction=policy.correction == "hajek",
                                            fixed=fixed)
                ests[h, a], truths[h, a] = est, truth
                o = out[it, h, a]
                err = est - truth
                o[K.F_ERR2] = err @ err
                o[K.F_REL] = np.sqrt(err @ err) / np.linalg.norm(truth)
                o[K.F_TAIL] = m
                tail = k_h & (p_h < 1)
                s_ = keys[k_h] @ q * trace.scale
                if policy.correction == "hajek":
                    s_ = s_ - np.log(p_h[k_h])
                w = np.zeros(k_h.size)
                w[k_h] = np.exp(s_ - s_.max())
                o[K.F_NEFF] = w[tail].sum() ** 2 / (w[tail] ** 2).sum() if m else 0.0
                o[K.F_KEPT] = kept[g, :tables.tau[e]].sum()
                o[K.F_EXPECTED] = pi[g, :tables.tau[e]].sum()
                o[K.F_EVENT] = e - tables.slot_ev[slot]
                full_w = np.exp(keys @ q * trace.scale - (keys @ q * trace.scale).max())
                full_w /= full_w.sum()
                out_set = ~k_h & (p_h > 0)
                ev_set = ~k_h & (p_h <= 0)
                pop = int((p_h < 1).sum())
                o[K.F_POP] = pop
                o[K.F_OUT_MASS] = full_w[out_set].sum()
                o[K.F_OUT_MAX] = full_w[out_set].max() if out_set.any() else 0.0
                o[K.F_EV_MASS] = full_w[ev_set].sum()
                o[K.F_EV_MAX] = full_w[ev_set].max() if ev_set.any() else 0.0
                if not policy.certified:
                    continue
                if m > 0:
                    o[K.F_MAX_TAIL] = (w[tail] / w.sum()).max()
                tr = np.trace(V)
                o[K.F_CERT2] = tr
                o[K.F_TRV2] = (V * V).sum()
                o[K.F_CERT2_SMALL] = 0.0 if pop == 0 else (np.inf if m <= 1 else tr * m / (m - 1))
                if pop == 0:
                    o[K.F_WALD] = o[K.F_WALD_T] = np.nan
                else:
                    sd = np.sqrt(np.maximum(np.diag(V), 0))
                    o[K.F_WALD] = np.mean(np.abs(err) <= z * sd)
                    if m <= 1:
                        o[K.F_WALD_T] = 1.0
                    else:
                        tq = stats.t.ppf(1 - alpha / 2, m - 1) * np.sqrt(m / (m - 1))
                        o[K.F_WALD_T] = np.mean(np.abs(err) <= tq * sd)
        if W is not None:
            for a in range(qidx.size):
                delta = W @ (ests[:, a] - truths[:, a]).reshape(-1)
                lout[it, a, K.L_ERR2] = delta @ delta
            if policy.certified:
                for a, (qi, t) in enumerate(zip(qidx, qpos, strict=True)):
                    e = qev[a]
                    pi = tables.pi[e][:, :t + 1]
                    u_e = np.stack([event_uniforms(tables, e, int(seeds[s]), trace.layer, g,
                                                   u[s, g]) for g in range(trace.n_kv_heads)])
                    kept = ((tables.kmask[ks] > 0) if ks >= 0 else (u_e < tables.pi[e]))
                    lout[it, a, K.L_CERT2] = output_space_reference(
                        trace.queries[:, [qi]], trace.keys[:, :t + 1], trace.values[:, :t + 1],
                        pi, kept[:, :t + 1], W, trace.scale)[0]
    return out, lout
