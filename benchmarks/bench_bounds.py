"""Tightness and memory of page-summary bound variants on real traces (docs/bounds.md).

For a deterministic top-k policy (one-shot after prefill), every decode query of the chosen
layers and heads: the bound on ``|o_R - o|`` (``o_R`` = the kept-only average, top-k's own
estimate) from each summary of the missing tokens, divided by the true error; the bound on the
missing mass divided by the true mass; and the summary memory as a share of the kept tokens.

Variants:

- ``box P``: elementwise key min/max per page of P positions + value centroid/radius (the
  replay's ``summary_page``);
- ``qpca r P``: key min/max in the top-r principal directions of the stored window (prompt)
  queries of the KV head's group + the residual-norm term; ``kpca r P``: same in the top-r
  directions of the missing keys;
- ``quant b``: every missing key quantized per channel to b bits (cells from the head's
  per-coordinate min/max), value centroid/radius per page of 64.

Usage::

    python benchmarks/bench_bounds.py STORE [--layers 4,14,24] [--sequences 2] [--budget 0.25]
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

import numpy as np

from tracesim.bounds import attention_error_bound, build_page_summaries, summary_tokens
from tracesim.policies import make_policy
from tracesim.replay import load_layer
from tracesim.replay.kept import first_event_inclusion
from tracesim.store import open_store


def quantized_summaries(K, V, miss, bits, value_page=64):
    """Per-token key cells (b bits per channel) with value summaries of ``value_page`` pages."""
    tok = build_page_summaries(K, V, miss, 1)
    vals = build_page_summaries(K, V, miss, value_page)
    Km = K[tok.first]
    lo, hi = Km.min(0), Km.max(0)
    step = np.where(hi > lo, (hi - lo) / (2**bits - 1), 1.0)
    rec = lo + np.round((Km - lo) / step) * step
    half = step / 2 * (1 + 1e-9)  # the reconstruction is within half a step of the key
    pg = np.searchsorted(vals.first, tok.first, side="right") - 1
    summ = replace(tok, kmin=rec - half, kmax=rec + half, vcen=vals.vcen[pg],
                   vrad=vals.vrad[pg])
    d = K.shape[1]
    numbers = tok.n_pages * d * bits / 16 + vals.n_pages * (d + 3) + 2 * d
    return summ, numbers / (2 * d)


def variants(tr, g, miss):
    K, V = tr.keys[g], tr.values[g]
    d = K.shape[1]
    roles = np.array(tr.query_roles)
    win = np.flatnonzero(roles != "decode")
    heads = range(g * tr.group_size, (g + 1) * tr.group_size)
    vq = np.linalg.svd(np.concatenate([tr.queries[h, win] for h in heads]),
                       full_matrices=False)[2]
    vk = np.linalg.svd(K[miss], full_matrices=False)[2]
    out = {}
    for P in (1, 2, 4, 8, 16, 32, 64):
        s = build_page_summaries(K, V, miss, P)
        out[f"box P={P}"] = (s, summary_tokens(s))
    for r, P in ((1, 16), (4, 16), (16, 16), (4, 64), (16, 64)):
        s = build_page_summaries(K, V, miss, P, basis=vq[:r].T)
        out[f"qpca r={r} P={P}"] = (s, summary_tokens(s))
    s = build_page_summaries(K, V, miss, 16, basis=vk[:16].T)
    out["kpca r=16 P=16"] = (s, summary_tokens(s))
    for b in (3, 4, 5, 6):
        out[f"quant {b} bits"] = quantized_summaries(K, V, miss, b)
    assert d > 0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store")
    ap.add_argument("--layers", default="4,14,24")
    ap.add_argument("--sequences", type=int, default=2, help="first N sequences")
    ap.add_argument("--budget", type=float, default=0.25)
    args = ap.parse_args()
    st = open_store(args.store)
    pol = make_policy("snapkv", "topk", args.budget)
    res: dict[str, list] = {}
    for sid in st.sequence_ids[:args.sequences]:
        seq = st[sid]
        for layer in (int(x) for x in args.layers.split(",")):
            tr = load_layer(st, seq, layer)
            _, kept = first_event_inclusion(tr, pol, 0, st.model.n_layers)
            dec = np.flatnonzero(np.array(tr.query_roles) == "decode")
            first_dec = int(tr.query_positions[dec].min())
            for g in range(tr.n_kv_heads):
                K, V = tr.keys[g], tr.values[g]
                miss = ~kept[g]
                miss[first_dec:] = False  # decode tokens are never evicted one-shot
                n_kept = kept[g][:first_dec].sum()
                summ = variants(tr, g, miss)
                for h in range(g * tr.group_size, (g + 1) * tr.group_size):
                    for qi in dec:
                        t = int(tr.query_positions[qi])
                        q = tr.queries[h, qi]
                        kk = kept[g][:t + 1]
                        s = tr.scale * K[:t + 1] @ q
                        w = np.exp(s - s.max())
                        o = w @ V[:t + 1] / w.sum()
                        o_r = (w * kk) @ V[:t + 1] / (w * kk).sum()
                        err = np.linalg.norm(o_r - o)
                        mass = w[~kk].sum() / w.sum()
                        for name, (sm, tokens) in summ.items():
                            b = attention_error_bound(q, K[:t + 1], V[:t + 1], kk, sm, tr.scale)
                            res.setdefault(name, []).append(
                                (b.bound >= err, b.bound / err,
                                 (b.mass_bound / (1 - b.mass_bound + 1e-300))
                                 / (mass / (1 - mass)), tokens / n_kept))
        seq.close()
    n = len(next(iter(res.values())))
    print(f"{n} rows (decode queries x heads x layers x sequences), snapkv top-k at "
          f"{args.budget:g}, load {os.getloadavg()[0]:.1f}")
    print("| summary | coverage | median tightness | p90 | median E_U bound / E_U | "
          "memory (% of kept) |")
    print("|---|---|---|---|---|---|")
    for name, rows in res.items():
        a = np.array(rows, dtype=float)
        print(f"| {name} | {a[:, 0].mean():.3f} | {np.median(a[:, 1]):.1f} | "
              f"{np.quantile(a[:, 1], .9):.0f} | {np.median(a[:, 2]):.3g} | "
              f"{100 * np.median(a[:, 3]):.1f} |")


if __name__ == "__main__":
    main()
