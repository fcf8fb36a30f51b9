"""Per-step designs against their deterministic baseline and the prefill designs.

For every configuration of a replay or sweep output: Wald and Wald-t coverage of all rows (no
validity rule), the mean squared error, the ratio of that error to per-query top-k by the same
proxy at the same budget (the deterministic baseline at equal kept tokens), the mean kept
tokens per step and the proxy's fast-memory cost. Coverage carries a cluster-robust 95 %
interval by sequence (the rows of one sequence are not independent).

With ``--calibration DIR`` it also fits a split-conformal radius per configuration on the
calibration results and reports its held-out coverage: ``kappa`` is the smallest multiple with
``|o_hat - o| <= kappa C`` on a 95 % share of calibration rows (the ``ceil((n + 1) 0.95)``-th
smallest ``|o_hat - o| / C``), ``conf_cov`` the held-out share with ``|o_hat - o| <= kappa C``.
With ``--prereg`` it evaluates claims C9 (from the results) and C10 (from ``--peers`` output
of ``tracesim peers``).

Usage: ``python -m analysis.adaptive RESULTS_DIR [--calibration DIR] [--peers DIR ...]
[--prereg data/prereg.yaml]`` (``docs/adaptive.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.report import load_results

__all__ = ["adaptive_table", "conformal_radius", "evaluate_c9", "evaluate_c10", "main"]


def _cluster_se(values: pd.Series, clusters: pd.Series) -> tuple[float, float, int]:
    """Mean, cluster-robust (by sequence) standard error and number of clusters of a column;
    the error is NaN with fewer than 2 clusters (one sequence says nothing about the next)."""
    ok = values.notna()
    v, c = values[ok].to_numpy(float), clusters[ok].to_numpy()
    if v.size == 0:
        return float("nan"), float("nan"), 0
    m = v.mean()
    sums = pd.Series(v - m).groupby(c).sum().to_numpy()
    k = sums.size
    if k < 2:
        return float(m), float("nan"), k
    return float(m), float(np.sqrt(k / (k - 1) * (sums**2).sum()) / v.size), k


def _quantile(p: float, k: int) -> float:
    """Student quantile with ``k - 1`` degrees of freedom (``k`` clusters; NaN below 2)."""
    from scipy import stats

    return float(stats.t.ppf(p, k - 1)) if k >= 2 else float("nan")


def _cluster_ci(values: pd.Series, clusters: pd.Series) -> tuple[float, float]:
    """Mean and cluster-robust 95 % half-width (Student ``t_{k-1}``) of a column."""
    m, se, k = _cluster_se(values, clusters)
    return m, _quantile(0.975, k) * se


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


def _ratio(g: pd.DataFrame) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(g["err2"].to_numpy(float) / g["cert2"].to_numpy(float))


def conformal_radius(cal: pd.DataFrame, level: float = 0.95) -> dict[str, float]:
    """Split-conformal radius per certified configuration (see the module docstring)."""
    out = {}
    for cid, g in cal[cal["certified"]].groupby("config_id"):
        r = np.sort(np.where(np.isnan(_ratio(g)), np.inf, _ratio(g)))
        k = int(np.ceil((r.size + 1) * level)) - 1
        out[cid] = float(r[min(k, r.size - 1)]) if k < r.size else float("inf")
    return out


def _one_sided(values: pd.Series, clusters: pd.Series,
               p: float) -> tuple[float, float, float]:
    """Mean and the ``p`` one-sided bounds below and above it (``t_{k-1}``; NaN below 2
    clusters, which makes every verdict inconclusive)."""
    m, se, k = _cluster_se(values, clusters)
    half = _quantile(p, k) * se
    return m, m - half, m + half


def _matches(meta: pd.Series, want: dict) -> bool:
    from tracesim.policies.grid import parse_schedule

    params = json.loads(meta["score_params"]) if meta["score"] == "perstep" else {}
    if "schedule" in want:
        want = {**want, "schedule": parse_schedule(want["schedule"], "compare").label()}
    checks = {"score": meta["score"], "design": meta["design"], "budget": meta["budget"],
              "schedule": meta["config_id"].split("|")[4],
              "correction": meta["correction"], "mixture": meta["mixture"],
              "top_fraction": meta["top_fraction"], **params}
    return all(k in checks and checks[k] == v for k, v in want.items())


def evaluate_c9(df: pd.DataFrame, claim: dict, alpha: float) -> dict:
    """C9 on held-out results: coverage CI against the interval, paired MSE test vs top-k."""
    from scipy import stats

    first = df.drop_duplicates("config_id")
    pick = {}
    for role in ("primary", "baseline"):
        ids = [r.config_id for _, r in first.iterrows() if _matches(r, claim["compare"][role])]
        if len(ids) != 1:
            raise ValueError(f"C9: compare.{role} matches {len(ids)} configurations in the "
                             "results, expected exactly 1")
        pick[role] = ids[0]
    p = df[df.config_id == pick["primary"]]
    b = df[df.config_id == pick["baseline"]]
    lo_iv, hi_iv = claim["interval"]
    # (1 - 2 alpha) two-sided = alpha one-sided on each side
    cov, lo2, hi2 = _one_sided(p["wald_cov"], p["sequence_id"], 1 - alpha)
    _, lo1, hi1 = _one_sided(p["wald_cov"], p["sequence_id"], 1 - alpha / 2)
    mp = p.groupby("sequence_id")["err2"].mean()
    mb = b.groupby("sequence_id")["err2"].mean()
    if set(mp.index) != set(mb.index):
        raise ValueError("C9: the primary and baseline configurations cover different "
                         f"sequences ({len(mp)} and {len(mb)}), expected the same for the "
                         "paired test")
    mb = mb.loc[mp.index]
    if not ((mp > 0) & (mb > 0) & np.isfinite(mp) & np.isfinite(mb)).all():
        raise ValueError("C9: a sequence has a zero or non-finite MSE, expected positive "
                         "MSEs for the paired log-ratio test")
    ratio = np.log(mp / mb)
    t = stats.ttest_1samp(ratio.to_numpy(), 0.0, alternative="less")
    t_gt = stats.ttest_1samp(ratio.to_numpy(), 0.0, alternative="greater")
    within = lo_iv <= lo2 and hi2 <= hi_iv
    outside = hi1 < lo_iv or lo1 > hi_iv
    if within and t.pvalue < alpha:
        verdict = "supported"
    elif outside or t_gt.pvalue < alpha:
        verdict = "not supported"
    else:
        verdict = "inconclusive"
    return {"claim": "C9", "coverage": cov, "ci_90": (lo2, hi2), "ci_95": (lo1, hi1),
            "sequences": int(p.sequence_id.nunique()), "rows": len(p),
            "mse_ratio_geomean": float(np.exp(ratio.mean())), "mse_p": float(t.pvalue),
            "verdict": verdict, "primary": pick["primary"], "baseline": pick["baseline"]}


def evaluate_c10(peers: pd.DataFrame, claim: dict, alpha: float) -> dict:
    """C10: per configuration, the violation rate of vAttention's bound with a one-sided
    cluster-robust bound, against its nominal delta."""
    rows, verdicts = [], []
    for want in claim["compare"]:
        label = ("vattention(" + ",".join(f"{k}={want[k]:g}" for k in (
            "sinks", "local", "heavy", "base_rate", "epsilon", "delta")) + ")")
        g = peers[peers.config_id == label]
        if g.empty:
            raise ValueError(f"C10: no rows of {label} in the peers results")
        viol = 1.0 - g["peer_bound_ok"]
        rate, lo, hi = _one_sided(viol, g["sequence_id"], 1 - alpha)
        delta = float(want["delta"])
        verdicts.append("supported" if hi <= delta else
                        "not supported" if lo > delta else "inconclusive")  # NaN: neither
        rows.append({"config": label, "violation_rate": rate, "one_sided_bounds": (lo, hi),
                     "delta": delta, "rows": len(g), "sequences": int(g.sequence_id.nunique()),
                     "den_violation_rate": float(1.0 - g["peer_den_ok"].mean()),
                     "kept_tokens": float(g["kept_tokens"].mean())})
    verdict = ("not supported" if "not supported" in verdicts else
               "supported" if all(v == "supported" for v in verdicts) else "inconclusive")
    return {"claim": "C10", "configs": rows, "verdict": verdict}


def c9_claim(df: pd.DataFrame, prereg):
    """C9 as a row of the report's claims table (``not evaluated`` without per-step rows)."""
    from analysis.claims import ClaimResult

    claim = prereg.claims["C9"]
    if df.empty or "score" not in df or not (df["score"] == "perstep").any():
        return ClaimResult("C9", claim["hypothesis"], detail="no per-step results given")
    try:
        r = evaluate_c9(df, claim, prereg.claim_alpha("C9"))
    except ValueError as exc:
        return ClaimResult("C9", claim["hypothesis"], detail=str(exc))
    return ClaimResult("C9", claim["hypothesis"], estimate=r["coverage"],
                       ci_low=r["ci_90"][0], ci_high=r["ci_90"][1], pvalue=r["mse_p"],
                       verdict=r["verdict"],
                       detail=(f"held-out Wald coverage, 90 % CI by sequence ({r['sequences']} "
                               f"sequences, {r['rows']} rows); MSE / per-query top-k "
                               f"{r['mse_ratio_geomean']:.3g} (geometric mean over sequences)"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.adaptive", description=__doc__
                                 .splitlines()[0])
    ap.add_argument("results", help="a replay or sweep output directory")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--calibration", default=None,
                    help="results whose rows fit the conformal radius (another set of sequences)")
    ap.add_argument("--peers", nargs="*", default=[], help="tracesim peers output directories")
    ap.add_argument("--prereg", default=None, help="evaluate C9 and C10 of this file")
    args = ap.parse_args(argv)
    from analysis.adaptive_costs import cost_columns

    try:
        df, _ = load_results(Path(args.results))
        table = cost_columns(adaptive_table(df, args.head_dim), df, args.head_dim)
        if args.calibration:
            cal, _ = load_results(Path(args.calibration))
            radius = conformal_radius(cal)
            table["kappa"] = [radius.get(c, np.nan) for c in df.drop_duplicates(
                "config_id")["config_id"]]
            cover = {c: float(np.mean(_ratio(g) <= radius[c])) for c, g in
                     df[df["certified"]].groupby("config_id") if c in radius}
            table["conf_cov"] = [cover.get(c, np.nan) for c in df.drop_duplicates(
                "config_id")["config_id"]]
        claims = []
        if args.prereg:
            from analysis.prereg import load_prereg

            pre = load_prereg(args.prereg)
            claims.append(evaluate_c9(df, pre.claims["C9"], pre.claim_alpha("C9")))
            if args.peers:
                peers = pd.concat([pd.read_parquet(Path(d) / "peers.parquet")
                                   for d in args.peers])
                claims.append(evaluate_c10(peers, pre.claims["C10"], pre.claim_alpha("C10")))
    except (ValueError, OSError, KeyError) as exc:
        print(f"python -m analysis.adaptive: {exc}", file=sys.stderr)
        return 2
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        print(table.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    for c in claims:
        print(json.dumps(c, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
