"""Per-step designs against their deterministic baseline and the prefill designs.

For every configuration of a replay or sweep output: Wald and Wald-t coverage of all rows (no
validity rule), the mean squared error, the ratio of that error to per-query top-k by the same
proxy at the same budget (the deterministic baseline at equal kept tokens), the mean kept
tokens per step and the proxy's fast-memory cost. Coverage carries a cluster-robust 95 %
interval by sequence (the rows of one sequence are not independent).

Usage: ``python -m analysis.adaptive RESULTS_DIR`` (prints the table; ``docs/adaptive.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.report import load_results

__all__ = ["adaptive_table", "main"]


def _cluster_ci(values: pd.Series, clusters: pd.Series) -> tuple[float, float]:
    """Mean and cluster-robust (by sequence) 95 % half-width of a 0/1 coverage column."""
    ok = values.notna()
    v, c = values[ok].to_numpy(float), clusters[ok].to_numpy()
    if v.size == 0:
        return float("nan"), float("nan")
    m = v.mean()
    sums = pd.Series(v - m).groupby(c).sum().to_numpy()
    k = sums.size
    se = np.sqrt(k / max(k - 1, 1) * (sums**2).sum()) / v.size
    return float(m), float(1.96 * se)


def _proxy(row: pd.Series) -> str:
    if row["score"] != "perstep":
        return "—"
    return str(json.loads(row["score_params"]).get("proxy", "exact"))


def adaptive_table(df: pd.DataFrame, head_dim: int = 64) -> pd.DataFrame:
    """One row per configuration (see the module docstring), sorted as the study lists them."""
    from tracesim.proxies import make_proxy

    rows = []
    first = df.drop_duplicates("config_id").set_index("config_id")
    for cid, g in df.groupby("config_id", sort=False):
        meta = first.loc[cid]
        cov, hw = _cluster_ci(g["wald_cov"], g["sequence_id"])
        cov_t, _ = _cluster_ci(g["wald_t_cov"], g["sequence_id"])
        proxy = _proxy(meta)
        rows.append({
            "score": meta["score"], "proxy": proxy, "design": meta["design"],
            "schedule": cid.split("|")[4] if cid != "full" else "—",
            "budget": meta["budget"], "rows": len(g),
            "wald": cov, "wald_ci": hw, "wald_t": cov_t, "mse": float(g["err2"].mean()),
            "kept": float(g["kept_tokens"].mean()),
            "proxy_bits": (make_proxy(proxy).bits_per_token(head_dim) if proxy != "—"
                           else float("nan")),
        })
    out = pd.DataFrame(rows)
    topk = out[out.design == "topk"].set_index(["score", "proxy", "budget"])["mse"]
    key = list(zip(out.score, out.proxy, out.budget, strict=True))
    out["mse_vs_topk"] = [r.mse / topk[k] if k in topk.index else np.nan
                          for k, r in zip(key, out.itertuples(), strict=True)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.adaptive", description=__doc__
                                 .splitlines()[0])
    ap.add_argument("results", help="a replay or sweep output directory")
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args(argv)
    try:
        df, _ = load_results(Path(args.results))
        table = adaptive_table(df, args.head_dim)
    except (ValueError, OSError, KeyError) as exc:
        print(f"python -m analysis.adaptive: {exc}", file=sys.stderr)
        return 2
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
