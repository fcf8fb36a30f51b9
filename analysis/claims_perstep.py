"""Claims on the per-step designs: C9 (replay results) and C10 (vAttention, ``tracesim peers``).

C9: the pre-registered per-step Poisson design covers within its interval on held-out
sequences with an MSE no larger than per-query top-k by the same proxy (``docs/perstep.md``).
C10: vAttention's ``(epsilon, delta)`` statement, ``|o_hat - o| <= epsilon |o|`` failing at a
rate ``<= delta``, per configuration of its pre-registered list (``docs/peers.md``).
Intervals are cluster-robust by sequence with Student ``t_{k-1}`` quantiles
(:func:`tracesim.analysis.cluster.one_sided_bounds`).
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
from tracesim.analysis.claims import ClaimInputs, ClaimResult
from tracesim.analysis.cluster import one_sided_bounds, student_quantile

__all__ = ["META_COLUMNS", "c9_claim", "c9_from_sums", "c10_claim", "c11_claim", "evaluate_c9",
           "evaluate_c10", "perstep_sums", "pick_configs"]


def _matches(meta: pd.Series, want: dict) -> bool:
    from tracesim.policies.grid import parse_schedule

    params = json.loads(meta["score_params"]) if meta["score"] == "perstep" else {}
    if "schedule" in want:
        want = {**want, "schedule": parse_schedule(want["schedule"], "compare").label()}
    checks = {"score": meta["score"], "design": meta["design"], "budget": meta["budget"],
              # the full cache's id is "full": no schedule part
              "schedule": (meta["config_id"].split("|") + [None] * 5)[4],
              "correction": meta["correction"], "mixture": meta["mixture"],
              "top_fraction": meta["top_fraction"], **params}
    return all(k in checks and checks[k] == v for k, v in want.items())


#: Columns :func:`_matches` reads of a configuration's rows.
META_COLUMNS = ("config_id", "score", "score_params", "design", "budget", "correction",
                "mixture", "top_fraction")


def pick_configs(df: pd.DataFrame, claim: dict, claim_id: str = "C9"
                 ) -> tuple[pd.DataFrame, dict[str, str]]:
    """The rows of the claim's model (a ``model_id`` field keeps only its rows) and the one
    configuration id each of ``compare.primary`` and ``compare.baseline`` matches.

    ``df`` needs :data:`META_COLUMNS` only: one row per configuration is enough.
    """
    if "model_id" in claim:
        df = df[df["model_id"] == claim["model_id"]] if "model_id" in df else df.iloc[:0]
        if df.empty:
            raise ValueError(f"{claim_id}: no rows of model_id {claim['model_id']!r} in the "
                             "results")
    first = df.drop_duplicates("config_id")
    pick = {}
    for role in ("primary", "baseline"):
        ids = [r.config_id for _, r in first.iterrows() if _matches(r, claim["compare"][role])]
        if len(ids) != 1:
            raise ValueError(f"{claim_id}: compare.{role} matches {len(ids)} configurations in the "
                             "results, expected exactly 1")
        pick[role] = ids[0]
    return df, pick


def perstep_sums(results, claim: dict, claim_id: str) -> tuple[pd.DataFrame, pd.DataFrame,
                                                                  dict[str, str]]:
    """What :func:`c9_from_sums` needs, from a
    :class:`~tracesim.analysis.aggregate.ResultsDataset`: the configurations are picked on one
    row per configuration (a group-by), then the two picked configurations' rows are summed per
    (configuration, sequence), and the primary's coverage per attention kind: two DuckDB
    group-bys whose results grow with sequences, never with rows."""
    from tracesim.analysis.aggregate import quote, sql_in

    model = (sql_in("model_id", [claim["model_id"]])
             if "model_id" in claim and "model_id" in results else "TRUE")
    if "model_id" in claim and "model_id" not in results:
        model = "FALSE"
    cols = [c for c in (*META_COLUMNS, "model_id") if c in results and c != "config_id"]
    meta = results.query(
        "SELECT \"config_id\", " + ", ".join(f"any_value({quote(c)}) AS {quote(c)}"
                                             for c in cols)
        + f" FROM results WHERE {model} GROUP BY \"config_id\"")
    _, pick = pick_configs(meta, claim, claim_id)
    values = [c for c in ("wald_cov", "err2") if c in results]
    by_seq = results.sums(["config_id", "sequence_id"], values,
                          f"{model} AND " + sql_in("config_id", list(pick.values())))
    by_kind = (results.sums(["attention_kind"], ["wald_cov"], f"{model} AND "
                            + sql_in("config_id", [pick["primary"]]))
               if "attention_kind" in results and "wald_cov" in results else None)
    return by_seq, by_kind, pick


def _sums_of(df: pd.DataFrame, keys: list[str], values: list[str]) -> pd.DataFrame:
    """:meth:`ResultsDataset.sums` of an in-memory table (pandas' group-by: null keys left out,
    NaN values not counted)."""
    g = df.groupby(keys, sort=True)
    out = g.size().rename("rows").to_frame()
    for c in values:
        out["n_" + c] = g[c].count()
        out["sum_" + c] = g[c].sum()
    return out.reset_index()


def _cluster_bounds(sums: pd.DataFrame, column: str, p: float) -> tuple[float, float, float]:
    """:func:`tracesim.analysis.cluster.one_sided_bounds` from per-sequence sums: the mean,
    and the cluster-robust standard error from each sequence's sum of residuals
    ``sum_c - mean * n_c``."""
    n = sums["n_" + column].to_numpy(float)
    s = sums["sum_" + column].to_numpy(float)
    keep = n > 0
    n, s = n[keep], s[keep]
    if n.size == 0:
        return float("nan"), float("nan"), float("nan")
    m = s.sum() / n.sum()
    k = n.size
    if k < 2:
        return float(m), float("nan"), float("nan")
    se = np.sqrt(k / (k - 1) * ((s - m * n) ** 2).sum()) / n.sum()
    half = student_quantile(p, k) * se
    return float(m), float(m - half), float(m + half)


def evaluate_c9(df: pd.DataFrame, claim: dict, alpha: float, claim_id: str = "C9") -> dict:
    """C9 on held-out results held in memory (the per-step study's command, tests): the rows
    summed per (configuration, sequence) with pandas, then :func:`c9_from_sums`.

    C11 is the same rule on another model's held-out sequences: ``claim_id`` names the claim in
    messages, and a ``model_id`` field of the entry keeps only that model's rows.
    """
    df, pick = pick_configs(df, claim, claim_id)
    rows = df[df["config_id"].isin(list(pick.values()))]
    by_seq = _sums_of(rows, ["config_id", "sequence_id"], ["wald_cov", "err2"])
    by_kind = (_sums_of(rows[rows["config_id"] == pick["primary"]], ["attention_kind"],
                        ["wald_cov"]) if "attention_kind" in rows else None)
    return c9_from_sums(by_seq, by_kind, pick, claim, alpha, claim_id)


def c9_from_sums(by_seq: pd.DataFrame, by_kind: pd.DataFrame | None, pick: dict[str, str],
                 claim: dict, alpha: float, claim_id: str = "C9") -> dict:
    """C9 from per-(configuration, sequence) sums of ``wald_cov`` and ``err2`` (columns
    ``rows``, ``n_<c>``, ``sum_<c>``): coverage CI against the interval (cluster-robust by
    sequence), paired MSE test vs top-k on the per-sequence mean errors."""
    from scipy import stats

    p = by_seq[by_seq["config_id"] == pick["primary"]].set_index("sequence_id")
    b = by_seq[by_seq["config_id"] == pick["baseline"]].set_index("sequence_id")
    lo_iv, hi_iv = claim["interval"]
    # (1 - 2 alpha) two-sided = alpha one-sided on each side
    cov, lo2, hi2 = _cluster_bounds(p, "wald_cov", 1 - alpha)
    _, lo1, hi1 = _cluster_bounds(p, "wald_cov", 1 - alpha / 2)
    mp = (p["sum_err2"] / p["n_err2"]).where(p["n_err2"] > 0)
    mb = (b["sum_err2"] / b["n_err2"]).where(b["n_err2"] > 0)
    if set(mp.index) != set(mb.index):
        raise ValueError(f"{claim_id}: the primary and baseline configurations cover different "
                         f"sequences ({len(mp)} and {len(mb)}), expected the same for the "
                         "paired test")
    mb = mb.loc[mp.index]
    if not ((mp > 0) & (mb > 0) & np.isfinite(mp) & np.isfinite(mb)).all():
        raise ValueError(f"{claim_id}: a sequence has a zero or non-finite MSE, expected positive "
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
    by_kind_cov = {}
    if by_kind is not None:
        for kind, n, s in by_kind[["attention_kind", "n_wald_cov", "sum_wald_cov"]].itertuples(
                index=False):
            by_kind_cov[str(kind)] = float(s / n) if n > 0 else float("nan")
    return {"claim": claim_id, "coverage": cov, "ci_90": (lo2, hi2), "ci_95": (lo1, hi1),
            "sequences": len(p), "rows": int(p["rows"].sum()),
            "mse_ratio_geomean": float(np.exp(ratio.mean())), "mse_p": float(t.pvalue),
            "verdict": verdict, "primary": pick["primary"], "baseline": pick["baseline"],
            "coverage_by_attention_kind": by_kind_cov}


def _vattention_label(want: dict) -> str:
    """The ``config_id`` ``tracesim peers`` gives the vAttention configuration ``want`` (the
    peer's own label: ``heavy: 1.0`` and ``heavy: 1`` are different configurations)."""
    from tracesim.peers import make_peer

    return make_peer("vattention", **{k: want[k] for k in (
        "sinks", "local", "heavy", "base_rate", "epsilon", "delta")}).label()


def evaluate_c10(peers: pd.DataFrame, claim: dict, alpha: float) -> dict:
    """C10: per configuration, the violation rate of vAttention's bound with a one-sided
    cluster-robust bound, against its nominal delta."""
    rows, verdicts = [], []
    for want in claim["compare"]:
        label = _vattention_label(want)
        g = peers[peers.config_id == label]
        if g.empty:
            raise ValueError(f"C10: no rows of {label} in the peers results")
        viol = 1.0 - g["peer_bound_ok"]
        rate, lo, hi = one_sided_bounds(viol, g["sequence_id"], 1 - alpha)
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


def c9_claim(inputs: ClaimInputs) -> ClaimResult:
    """C9 as a row of the claims table (``not evaluated`` without per-step rows, or with the
    reason the pre-registered configurations cannot be compared)."""
    return _perstep_claim(inputs, "C9")


def c11_claim(inputs: ClaimInputs) -> ClaimResult:
    """C11 (C9's rule on held-out Gemma 3 sequences) as a row of the claims table; the detail
    gives the coverage of sliding and full layers apart (descriptive)."""
    return _perstep_claim(inputs, "C11")


def _perstep_claim(inputs: ClaimInputs, claim_id: str) -> ClaimResult:
    ds, prereg = inputs.results, inputs.prereg
    claim = prereg.claims[claim_id]
    if ds.empty or "score" not in ds or ds.query(
            "SELECT count(*) AS n FROM (SELECT 1 FROM results WHERE \"score\" = 'perstep' "
            "LIMIT 1)")["n"].iloc[0] == 0:
        return ClaimResult(claim_id, claim["hypothesis"], detail="no per-step results given")
    try:
        by_seq, by_kind, pick = perstep_sums(ds, claim, claim_id)
        r = c9_from_sums(by_seq, by_kind, pick, claim, prereg.claim_alpha(claim_id), claim_id)
    except ValueError as exc:
        return ClaimResult(claim_id, claim["hypothesis"], detail=str(exc))
    kinds = "".join(f"; {kind} layers cover {cov:.3g}"
                    for kind, cov in sorted(r["coverage_by_attention_kind"].items())
                    if len(r["coverage_by_attention_kind"]) > 1)
    return ClaimResult(claim_id, claim["hypothesis"], estimate=r["coverage"],
                       ci_low=r["ci_90"][0], ci_high=r["ci_90"][1], pvalue=r["mse_p"],
                       verdict=r["verdict"],
                       detail=(f"held-out Wald coverage, 90 % CI by sequence ({r['sequences']} "
                               f"sequences, {r['rows']} rows); MSE / per-query top-k "
                               f"{r['mse_ratio_geomean']:.3g} (geometric mean over sequences)"
                               f"{kinds}"),
                       extra={"coverage_by_attention_kind": r["coverage_by_attention_kind"]})


def c10_claim(inputs: ClaimInputs) -> ClaimResult:
    """C10 as a row of the claims table, from the ``tracesim peers`` rows.

    The estimate is the violation rate of the configuration nearest its delta (the largest
    upper bound minus delta), with that configuration's one-sided ``1 - alpha`` bounds as the
    interval; every configuration is in ``extra["configs"]`` and the detail. The verdict rule
    compares bounds, not a p-value, so C10 takes no part in Holm's correction.
    """
    claim = inputs.prereg.claims["C10"]
    alpha = inputs.prereg.claim_alpha("C10")
    try:
        r = evaluate_c10(inputs.peers, claim, alpha)
    except ValueError as exc:
        return ClaimResult("C10", claim["hypothesis"], detail=str(exc))
    configs = r["configs"]
    nearest = max(configs, key=lambda c: (np.nan_to_num(c["one_sided_bounds"][1], nan=np.inf)
                                          - c["delta"]))
    lo, hi = nearest["one_sided_bounds"]
    parts = [f"{c['config']}: violation rate {c['violation_rate']:.3g} (one-sided "
             f"{1 - alpha:g} bounds {c['one_sided_bounds'][0]:.3g}, "
             f"{c['one_sided_bounds'][1]:.3g}) against delta {c['delta']:g}, {c['rows']} rows "
             f"of {c['sequences']} sequences, {c['kept_tokens']:.4g} tokens kept per step"
             for c in configs]
    return ClaimResult("C10", claim["hypothesis"], estimate=nearest["violation_rate"],
                       ci_low=lo, ci_high=hi, verdict=r["verdict"],
                       detail="; ".join(parts) + "; bounds cluster-robust by sequence",
                       extra={"configs": configs, "nearest": nearest["config"]})
