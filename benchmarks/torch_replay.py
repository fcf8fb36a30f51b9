"""A vectorized torch-CPU implementation of the replay math: the baseline of bench_replay.py.

Same inputs as the engine (one layer, the engine's inclusion tables and permanent uniforms),
same outputs for one-shot Poisson/Bernoulli/top-k policies: squared error, certificate
``tr V_hat``, Wald coverage, tail size, Kish n_eff and the oracle masses. It is written the way
one would write it in torch: dense masked softmax over every position, batched over seeds,
heads and queries, with matmuls for the weighted sums. Fixed-size designs, decode-time
schedules and the output-space certificate are not implemented (the benchmark does not use
them).
"""

from __future__ import annotations

import numpy as np
import torch

from tracesim.policies import LayerTrace, Policy
from tracesim.replay.engine import evaluated_queries
from tracesim.replay.inclusion import InclusionTables

__all__ = ["torch_replay"]


@torch.inference_mode()
def torch_replay(trace: LayerTrace, policies: list[Policy], tables: InclusionTables,
                 uniforms: np.ndarray, alpha: float = 0.05,
                 seed_chunk: int = 8) -> dict[str, np.ndarray]:
    """Replay with torch; returns per-iteration arrays shaped (n_iter, H, NQ)."""
    from scipy import stats

    f64 = torch.float64
    qidx = evaluated_queries(trace)
    qpos = torch.as_tensor(trace.query_positions[qidx])
    H, G, P = trace.n_heads, trace.group_size, trace.n_positions
    K = torch.as_tensor(trace.keys, dtype=f64)
    V = torch.as_tensor(trace.values, dtype=f64)
    Q = torch.as_tensor(trace.queries[:, qidx], dtype=f64)
    u = torch.as_tensor(uniforms, dtype=f64)
    causal = torch.arange(P)[None, :] > qpos[:, None]  # (NQ, P)
    logits = torch.einsum("hqd,hpd->hqp", Q, K.repeat_interleave(G, 0)) * trace.scale
    logits = logits.masked_fill(causal, -torch.inf)
    p_full = torch.softmax(logits, dim=-1)
    truth = p_full @ V.repeat_interleave(G, 0)
    z = float(stats.norm.ppf(1 - alpha / 2))
    n_it = tables.it_cfg.size
    names = ("err2", "cert2", "wald", "tail", "neff", "out_mass", "out_max", "ev_mass",
             "ev_max")
    res = {k: np.full((n_it, H, qidx.size), np.nan) for k in names}
    its = np.arange(n_it)
    for c, policy in enumerate(policies):
        mine = its[tables.it_cfg == c]
        corrected = policy.correction == "hajek"
        for start in range(0, mine.size, seed_chunk):
            chunk = mine[start:start + seed_chunk]
            e = tables.slot_ev[tables.it_slot[chunk[0]]]
            pi = torch.as_tensor(tables.pi[e], dtype=f64)  # (n_kv, P)
            kept = u[tables.it_seed[chunk]] < pi[None]  # (n, n_kv, P)
            tail = (pi < 1)[None] & kept
            for g in range(trace.n_kv_heads):
                hs = slice(g * G, (g + 1) * G)
                lw = logits[None, hs] - (torch.log(pi[g]) if corrected else 0.0)
                mask = ~kept[:, g, None, None, :]
                lw = lw.masked_fill(mask, -torch.inf)
                a = torch.softmax(lw, dim=-1)  # (n, G, NQ, P)
                est = a @ V[g]
                diff = est - truth[None, hs]
                out = {"err2": (diff**2).sum(-1)}
                vis_tail = tail[:, g, None, None, :] & ~causal[None, None]
                aw = a * vis_tail
                out["tail"] = vis_tail.sum(-1).expand_as(out["err2"]).to(f64)
                s1, s2 = aw.sum(-1), (aw**2).sum(-1)
                out["neff"] = torch.where(s2 > 0, s1**2 / s2, torch.zeros_like(s1))
                notkept = ~kept[:, g, None, None, :]
                pf = p_full[None, hs]
                out_set = notkept & (pi[g] > 0)
                ev_set = notkept & (pi[g] <= 0)
                out["out_mass"] = (pf * out_set).sum(-1)
                out["out_max"] = (pf * out_set).amax(-1)
                out["ev_mass"] = (pf * ev_set).sum(-1).expand_as(out["err2"])
                out["ev_max"] = (pf * ev_set).amax(-1).expand_as(out["err2"])
                if policy.certified:
                    w2 = (1 - pi[g]) * a**2 * vis_tail
                    T = w2 @ V[g]
                    D = w2 @ V[g] ** 2
                    s0 = w2.sum(-1, keepdim=True)
                    diag = (D - 2 * est * T + est**2 * s0).clamp_min(0)
                    out["cert2"] = diag.sum(-1)
                    pop = ((pi[g] < 1) & ~causal).sum(-1)  # (NQ,)
                    wald = (diff.abs() <= z * diag.sqrt()).to(f64).mean(-1)
                    out["wald"] = torch.where(pop > 0, wald, torch.nan)
                for k, v in out.items():
                    res[k][chunk, hs] = v.numpy()
    return res
