"""A small synthetic results table with the replay's columns, for the frontier and C8 tests.

Coverage is built to depend on Kish n_eff (rows with n_eff < 8 cover with probability 0.6,
the others with 0.96), so a validity rule on n_eff has something to find.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

SNAP = json.dumps({"kernel": 5, "pooling": "avg", "question_aware": True})


def synthetic_results(n_seq: int = 24, seeds: int = 4, seed: int = 0,
                      bound: bool = False, weight: bool = False) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    budgets = (0.1, 0.25, 0.5)
    for s in range(n_seq):
        sid = f"{'passkey' if s % 2 else 'multikey'}-L1024-s0-{s:04d}"
        for design in ("topk", "poisson"):
            for b in budgets:
                cert = design == "poisson"
                cid = (f"snapkv(sinks=4,window=32)|{design}(mixture=0.1,floor=0)|"
                       f"{'hajek' if cert else 'none'}|uniform:{b}|oneshot")
                for layer in (3, 18):
                    for head in range(3):
                        for q in range(4):
                            for sd in (range(seeds) if cert else [-1]):
                                neff = rng.gamma(2.0, 8.0 * b / 0.25) if cert else 0.0
                                m = neff * 2 + rng.integers(0, 4) if cert else 0.0
                                p = 0.96 if neff >= 8 else 0.6
                                err2 = rng.gamma(2.0, (0.02 if cert else 0.03) / b)
                                r = dict(
                                    sequence_id=sid, task=sid.split("-")[0], layer=layer,
                                    head=head, query_role="decode", config_id=cid,
                                    score="snapkv", score_params=SNAP, design=design,
                                    correction="hajek" if cert else "none", budget=b,
                                    budget_unit="fraction", allocator="uniform",
                                    schedule="oneshot", mixture=0.1 if cert else np.nan,
                                    floor=0.0 if cert else np.nan, certified=cert,
                                    seed=sd, n_seeds=1, err2=err2, rel_err=np.sqrt(err2),
                                    cert2=err2 * 0.8 if cert else np.nan, tail_size=m,
                                    n_eff=neff,
                                    wald_cov=float(rng.random() < p) if cert else np.nan,
                                    wald_t_cov=float(rng.random() < p + 0.02) if cert
                                    else np.nan,
                                    kept_tokens=1024 * b + (rng.normal(0, 5) if cert else 0),
                                    tail_out_mass=rng.beta(1, 20), kv_head=head,
                                    query_index=q, query_position=1024 + q, prompt_length=1024)
                                if weight:
                                    r["max_tail_weight"] = (1 / (1 + neff)) if cert else np.nan
                                if bound:
                                    r["bound2"] = err2 * rng.uniform(4, 100)
                                    r["bound_cov"] = True
                                    r["summary_tokens"] = 16.0
                                rows.append(r)
    return pd.DataFrame(rows)
