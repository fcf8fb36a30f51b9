"""Claims evaluated from the offline simulator: C0 (adversary), C1 (coverage) and C2 (attention
error); C5 and C7 are in :mod:`tracesim.analysis.claims_gating`.

Inputs are the replay results table (``tracesim replay`` / ``tracesim sweep``; columns in
``docs/replay.md``) as a pandas DataFrame, aggregated over seeds, and the pre-registration.
C1 and C2 read the eviction designs only (schedules ``oneshot`` and ``decode``): the per-step
designs (schedule ``step``) are C9's. The ``c*_claim`` functions are the claims table's entries
(:mod:`tracesim.analysis.claim_registry`): they take the report's
:class:`tracesim.analysis.claims.ClaimInputs`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from scipy import stats
from tracesim.analysis.aggregate import quote, sql_in
from tracesim.analysis.claims import (
    CERTIFICATES,
    INCONCLUSIVE,
    NOT_SUPPORTED,
    SUPPORTED,
    ClaimInputs,
    ClaimResult,
    Fail,
    certified_where,
    eviction_rows,
    eviction_where,
)
from tracesim.analysis.claims_outcomes import evaluate_c2_accuracy
from tracesim.analysis.equivalence import paired_tost

__all__ = ["c0_claim", "c1_claim", "c2_claim", "check_c1", "eviction_rows", "evaluate_c0",
           "evaluate_c1", "evaluate_c2_attention", "tail_bins"]

#: Primary coverage events C1 may pre-register (``primary_event:``).
C1_EVENTS = ("wald", "satterthwaite")


def _claim(prereg, cid: str) -> tuple[dict[str, Any], float]:
    claim = prereg.claims[cid]
    return claim, prereg.claim_alpha(cid)


def evaluate_c0(adversary: dict[str, Any] | None, prereg) -> ClaimResult:
    """C0 from the adversary demo's rows (``adversary.json``)."""
    claim, _ = _claim(prereg, "C0")
    res = ClaimResult("C0", claim["hypothesis"])
    if not adversary or not adversary.get("rows"):
        res.detail = "no adversary demo in the inputs"
        return res
    rows = sorted(adversary["rows"], key=lambda r: r["t"])
    identical = all(r["topk_identical"] for r in rows)
    e0, e1 = rows[0]["topk_err2"], rows[-1]["topk_err2"]
    c0, c1 = rows[0]["poisson_cert2"], rows[-1]["poisson_cert2"]
    growth = e1 / e0 if e0 > 0 else np.inf
    res.estimate = float(growth)
    res.extra = {"retained_identical": identical, "topk_err2_first": e0, "topk_err2_last": e1,
                 "poisson_cert2_first": c0, "poisson_cert2_last": c1,
                 "t_max": rows[-1]["t"]}
    ok = identical and growth > 10 and c1 > c0
    res.verdict = SUPPORTED if ok else NOT_SUPPORTED
    res.detail = (f"top-k retained cache identical at every t: {identical}; true error grew "
                  f"{growth:.3g}x from t=0 to t={rows[-1]['t']:g}; Poisson certificate "
                  f"{c0:.3g} -> {c1:.3g}")
    return res


TAIL_LABELS = ["m<8", "8<=m<32", "32<=m<128", "m>=128"]
NEFF_LABELS = ["n_eff<4", "4-16", "16-64", ">=64"]
MASS_LABELS = ["<0.01", "0.01-0.05", "0.05-0.2", ">=0.2"]


def tail_bins(m: pd.Series) -> pd.Series:
    """Stratum labels of the realized tail size."""
    edges = [-np.inf, 8, 32, 128, np.inf]
    return pd.cut(m, edges, right=False, labels=TAIL_LABELS).astype(str)


def _certified(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["certified"].astype(bool) & df["cert2"].notna()]


def _bins_sql(column: str, edges: tuple[float, ...], labels: list[str]) -> str:
    """SQL of ``pd.cut(column, [-inf, *edges, inf], right=False, labels=labels).astype(str)``:
    the label of the bin, ``'nan'`` for a missing or infinite value."""
    x = f"CAST({quote(column)} AS DOUBLE)"
    whens = "".join(f" WHEN {x} < {e!r} THEN '{lab}'" for e, lab in zip(
        (*edges, float("inf")), labels, strict=True)).replace("inf THEN", "'inf' THEN")
    return f"CASE WHEN {x} IS NULL OR isnan({x}) THEN 'nan'{whens} ELSE 'nan' END"


def _as_dataset(results):
    from tracesim.analysis.aggregate import ResultsDataset

    return ResultsDataset.from_frame(results) if isinstance(results, pd.DataFrame) else results


def evaluate_c1(results, prereg) -> tuple[ClaimResult, dict[str, Any]]:
    """Certificate coverage, cluster-robust by sequence, stratified by tail size and more.

    Computed from sums per (sequence, stratum) of the coverage event (one DuckDB group-by over
    the results, :func:`tracesim.analysis.aggregate.coverage_from_sums`), never from the rows:
    the estimate and its GEE sandwich interval are functions of those sums.
    """
    from tracesim.analysis.aggregate import coverage_from_sums, notna

    claim, alpha = _claim(prereg, "C1")
    res = ClaimResult("C1", claim["hypothesis"])
    column = {("wald", "primary"): "wald_cov", ("wald", "small_sample"): "wald_t_cov",
              ("satterthwaite", "primary"): "sat_cov",
              ("satterthwaite", "small_sample"): "sat_t_cov"}[
        (claim["primary_event"], claim["certificate"])]
    ds = _as_dataset(results)
    want = claim.get("compare", {})
    sums = pd.DataFrame()
    if column in ds and not ds.empty:
        where = f"{eviction_where(ds)} AND {certified_where()} AND {notna(column)}"
        if "design" in want:
            where += " AND " + sql_in("design", [want["design"]])
        sums = ds.sums(["sequence_id",
                        _bins_sql("tail_size", (8, 32, 128), TAIL_LABELS) + " AS tail_bin",
                        _bins_sql("n_eff", (4, 16, 64), NEFF_LABELS) + " AS neff_bin",
                        _bins_sql("tail_out_mass", (0.01, 0.05, 0.2), MASS_LABELS)
                        + " AS mass_bin"], [column], where)
    if sums.empty or sums[f"n_{column}"].sum() == 0:
        res.detail = f"no certified rows with {column} (primary event {claim['primary_event']})"
        return res, {}
    nominal = float(claim["nominal"])
    threshold = nominal - float(claim.get("margin", 0.0))
    overall = coverage_from_sums(sums, column, None, "sequence_id", nominal=nominal,
                                 alpha=alpha)
    res.estimate = float(overall.coverage[0])
    res.ci_low, res.ci_high = float(overall.ci_low[0]), float(overall.ci_high[0])
    # One-sided test of H0: coverage <= nominal - margin, on the logit scale of the GEE fit.
    se = (np.log(res.ci_high / (1 - res.ci_high)) - np.log(res.ci_low / (1 - res.ci_low))) / (
        2 * stats.norm.ppf(1 - alpha / 2)) if 0 < res.ci_low < res.ci_high < 1 else np.nan
    if np.isfinite(se) and se > 0:
        logit = np.log(res.estimate / (1 - res.estimate))
        res.pvalue = float(stats.norm.sf((logit - np.log(threshold / (1 - threshold))) / se))
    if res.ci_low >= threshold:
        res.verdict = SUPPORTED
    elif res.ci_high < threshold:
        res.verdict = NOT_SUPPORTED
    else:
        res.verdict = INCONCLUSIVE
    strata = {name: coverage_from_sums(sums, column, key, "sequence_id", nominal=nominal,
                                       alpha=alpha, order=order)
              for name, key, order in (("tail size", "tail_bin", TAIL_LABELS),
                                       ("Kish n_eff", "neff_bin", NEFF_LABELS),
                                       ("oracle sampled-out mass", "mass_bin", MASS_LABELS))}
    res.detail = (f"{column} over {overall.n_events[0]} (query, head, config) rows from "
                  f"{overall.n_clusters[0]} sequences; threshold {threshold:.3f}")
    res.extra = {"column": column, "threshold": threshold}
    return res, strata


def evaluate_c2_attention(results, prereg) -> ClaimResult:
    """Paired TOST of relative attention error: Poisson/Hájek vs top-k at equal budget.

    The per-(sequence, score, budget) means come from sums and counts of ``rel_err`` (one
    DuckDB group-by), not from the rows.
    """
    claim, alpha = _claim(prereg, "C2")
    res = ClaimResult("C2", claim["hypothesis"])
    ds = _as_dataset(results)
    keys = ["sequence_id", "score", "budget"]
    cells = pd.DataFrame(columns=["random", "topk"])
    if not ds.empty and {*keys, "design", "correction", "rel_err"} <= set(ds.columns):
        where = (f"{eviction_where(ds)} AND ((\"design\" = 'poisson' AND \"correction\" = "
                 "'hajek') OR \"design\" = 'topk')")
        sums = ds.sums([*keys, "CASE WHEN \"design\" = 'topk' THEN 'topk' ELSE 'random' END "
                        "AS arm"], ["rel_err"], where)
        sums["mean"] = (sums["sum_rel_err"] / sums["n_rel_err"]).where(sums["n_rel_err"] > 0)
        cells = sums.set_index([*keys, "arm"])["mean"].unstack("arm")
        cells = cells.reindex(columns=["random", "topk"]).dropna()
    # Cells of one sequence share its tokens: the independent units are the sequences.
    both = cells.groupby(level="sequence_id").mean() if len(cells) else cells
    if len(both) < 2:
        res.detail = "needs poisson/hajek and top-k rows at the same score and budget"
        return res
    test = paired_tost(both["random"].to_numpy(), both["topk"].to_numpy(),
                       float(claim["margin"]), alpha=alpha)
    res.estimate, res.ci_low, res.ci_high = test.mean_difference, test.ci_low, test.ci_high
    res.pvalue = test.pvalue
    margin = float(claim["margin"])
    if test.supported:
        res.verdict = SUPPORTED
    elif test.ci_low > margin or test.ci_high < -margin:
        res.verdict = NOT_SUPPORTED
    else:
        res.verdict = INCONCLUSIVE
    res.detail = (f"mean rel. error difference (poisson - top-k) over {len(both)} sequences "
                  f"({len(cells)} (sequence, score, budget) cells averaged per sequence), "
                  f"margin ±{margin}")
    res.extra = {"pairs": len(both), "mean_random": float(both["random"].mean()),
                 "mean_topk": float(both["topk"].mean())}
    return res


def check_c1(claim: dict[str, Any], fail: Fail) -> None:
    """C1's own pre-registration fields: the primary event, the certificate and the nominal."""
    if claim.get("primary_event") not in C1_EVENTS:
        fail("claims.C1.primary_event", f"expected one of {list(C1_EVENTS)}")
    if claim.get("certificate") not in CERTIFICATES:
        fail("claims.C1.certificate", f"expected one of {list(CERTIFICATES)}")
    if not isinstance(claim.get("nominal"), (int, float)) or not 0 < claim["nominal"] < 1:
        fail("claims.C1.nominal", "expected a number in (0, 1)")


def c0_claim(inputs: ClaimInputs) -> ClaimResult:
    """C0 from the adversary demo (``not evaluated`` without one)."""
    return evaluate_c0(inputs.adversary, inputs.prereg)


def c1_claim(inputs: ClaimInputs) -> ClaimResult:
    """C1; leaves its strata for the coverage figure as ``artifacts["C1 strata"]``."""
    res, strata = evaluate_c1(inputs.results, inputs.prereg)
    inputs.artifacts["C1 strata"] = strata
    return res


def c2_claim(inputs: ClaimInputs) -> ClaimResult:
    """C2 on attention error from the replay results, with the end-to-end accuracy TOST of the
    in-loop outcomes added to its detail when they are given (either input may be absent)."""
    if inputs.given("results"):
        res = evaluate_c2_attention(inputs.results, inputs.prereg)
    else:
        res = ClaimResult("C2", inputs.hypothesis("C2"), detail="no replay results given")
    if inputs.given("outcomes"):
        extra = evaluate_c2_accuracy(inputs.outcomes, 0.05, inputs.prereg.claim_alpha("C2"))
        res.extra.update(extra)
        if extra:
            res.detail += (f"; end to end: accuracy difference "
                           f"{extra['accuracy_difference']:+.3f} over "
                           f"{extra['accuracy_pairs']} pairs, TOST p = "
                           f"{extra['accuracy_tost_p']:.3g}")
    return res
