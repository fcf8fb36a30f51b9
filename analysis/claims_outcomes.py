"""Claims evaluated from in-loop outcomes (``tracesim evict``): C2 end to end, C3, C4, C6.

One outcomes row per (sequence, policy, seed) with ``correct``, ``full_correct``, ``failure``,
log-prob summaries and certificate aggregates (see ``docs/evict.md``). The ``c*_claim``
functions are the claims table's entries (:mod:`tracesim.analysis.claim_registry`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from tracesim.analysis.auc import cluster_bootstrap_auc, delong_auc, delong_paired_test
from tracesim.analysis.claims import (
    INCONCLUSIVE,
    NOT_SUPPORTED,
    SUPPORTED,
    ClaimInputs,
    ClaimResult,
)
from tracesim.analysis.equivalence import paired_noninferiority, paired_tost

from tracesim.safeio import loads_json

__all__ = ["c3_claim", "c4_claim", "c6_claim", "evaluate_c2_accuracy", "evaluate_c3",
           "evaluate_c4", "evaluate_c6"]


def _question_aware(params: str) -> bool:
    try:
        return bool(loads_json(params, "score_params").get("question_aware", True))
    except (AttributeError, TypeError, ValueError):
        return True


def evaluate_c2_accuracy(outcomes: pd.DataFrame, margin: float, alpha: float) -> dict:
    """End-to-end accuracy, Poisson/Hájek vs top-k at equal budget (paired TOST by sequence)."""
    rand = outcomes[(outcomes["design"] == "poisson") & (outcomes["correction"] == "hajek")]
    det = outcomes[outcomes["design"] == "topk"]
    keys = ["sequence_id", "score", "budget"]
    both = pd.concat([rand.groupby(keys)["correct"].mean().rename("random"),
                      det.groupby(keys)["correct"].mean().rename("topk")], axis=1).dropna()
    both = both.groupby(level="sequence_id").mean()  # sequences are the independent units
    if len(both) < 2:
        return {}
    test = paired_tost(both["random"].to_numpy(float), both["topk"].to_numpy(float), margin,
                       alpha=alpha)
    return {"accuracy_difference": test.mean_difference, "accuracy_ci": (test.ci_low,
            test.ci_high), "accuracy_tost_p": test.pvalue, "accuracy_pairs": len(both),
            "accuracy_equivalent": test.supported}


def evaluate_c3(outcomes: pd.DataFrame, prereg) -> ClaimResult:
    """Question-aware SnapKV at 25-50% budget vs the full cache (paired non-inferiority)."""
    claim = prereg.claims["C3"]
    alpha = prereg.claim_alpha("C3")
    res = ClaimResult("C3", claim["hypothesis"])
    budgets = claim.get("compare", {}).get("budget", [0.25, 0.5])
    df = outcomes[(outcomes["score"] == "snapkv") & outcomes["budget"].isin(budgets)
                  & outcomes["score_params"].map(_question_aware)]
    if df.empty:
        res.detail = f"no question-aware snapkv outcomes at budgets {budgets}"
        return res
    per = df.groupby("sequence_id").agg(acc=("correct", "mean"),
                                        full=("full_correct", "mean"))
    if len(per) < 2:
        res.detail = "too few sequences"
        return res
    margin = float(claim["margin"])
    test = paired_noninferiority(per["acc"].to_numpy(float), per["full"].to_numpy(float),
                                 margin, alpha=alpha)
    res.estimate, res.ci_low, res.ci_high, res.pvalue = (test.mean_difference, test.ci_low,
                                                         np.nan, test.pvalue)
    drop_upper = -test.ci_low  # largest accuracy drop the data allow
    if test.supported:
        res.verdict = SUPPORTED
    elif -test.mean_difference > margin and drop_upper > margin:
        res.verdict = NOT_SUPPORTED
    else:
        res.verdict = INCONCLUSIVE
    res.detail = (f"accuracy (evicted - full) over {len(per)} sequences (mean over budgets) at "
                  f"budgets {budgets}; margin {margin}; one-sided lower bound {test.ci_low:+.3f}")
    return res


def _auc_verdict(res: ClaimResult, favours_a: bool, significant: bool) -> None:
    if significant and favours_a:
        res.verdict = SUPPORTED
    elif significant:
        res.verdict = NOT_SUPPORTED
    else:
        res.verdict = INCONCLUSIVE


def evaluate_c4(outcomes: pd.DataFrame, prereg) -> tuple[ClaimResult, dict]:
    """Output log-prob vs the certificate as predictors of failure (paired DeLong)."""
    claim = prereg.claims["C4"]
    alpha = prereg.claim_alpha("C4")
    res = ClaimResult("C4", claim["hypothesis"])
    df = outcomes[outcomes["certified"].astype(bool) & outcomes["certificate_mean"].notna()]
    failed = ~df["correct"].astype(bool)
    if df.empty or failed.all() or not failed.any():
        res.detail = "needs certified outcomes with both failures and successes"
        return res, {}
    a = -df["logprob_mean"].to_numpy(float)
    b = df["certificate_mean"].to_numpy(float)
    test = delong_paired_test(a, b, failed.to_numpy(), alpha=alpha)
    # Runs of one sequence are dependent: the interval and p-value resample sequences.
    boot = cluster_bootstrap_auc(a, failed.to_numpy(), df["sequence_id"].to_numpy(),
                                 scores_b=b, alpha=alpha)
    res.estimate, res.ci_low, res.ci_high, res.pvalue = (boot.estimate, boot.ci_low,
                                                         boot.ci_high, boot.pvalue)
    _auc_verdict(res, boot.estimate > 0, boot.pvalue < alpha)
    res.detail = (f"AUC(-mean log-prob) {test.auc_a:.3f} vs AUC(certificate) {test.auc_b:.3f} "
                  f"for failure, {len(df)} runs ({int(failed.sum())} failed) from "
                  f"{boot.n_clusters} sequences; cluster-bootstrap CI and p (DeLong p, which "
                  f"treats runs as independent: {test.pvalue:.3g})")
    curves = {"failure: -mean log-prob": (a, failed.to_numpy()),
              "failure: certificate": (b, failed.to_numpy())}
    return res, curves


def evaluate_c6(outcomes: pd.DataFrame, prereg) -> tuple[ClaimResult, dict]:
    """Among failures: does the certificate separate cache-induced from inherent ones?"""
    claim = prereg.claims["C6"]
    alpha = prereg.claim_alpha("C6")
    res = ClaimResult("C6", claim["hypothesis"])
    df = outcomes[outcomes["certified"].astype(bool) & ~outcomes["correct"].astype(bool)
                  & outcomes["certificate_max"].notna()]
    label = (df["failure"] == "cache_induced").to_numpy()
    if df.empty or label.all() or not label.any():
        res.detail = ("needs failed certified runs of both kinds (cache-induced and inherent); "
                      f"have {int(label.sum())} cache-induced of {len(df)}")
        return res, {}
    cert = df["certificate_max"].to_numpy(float)
    conf = -df["logprob_mean"].to_numpy(float)
    groups = df["sequence_id"].to_numpy()
    auc = delong_auc(cert, label, alpha=alpha)
    paired = delong_paired_test(cert, conf, label, alpha=alpha)
    # Failures of one sequence are dependent: intervals and p-values resample sequences.
    boot = cluster_bootstrap_auc(cert, label, groups, alpha=alpha)
    boot_pair = cluster_bootstrap_auc(cert, label, groups, scores_b=conf, alpha=alpha)
    res.estimate, res.ci_low, res.ci_high, res.pvalue = (auc.auc, boot.ci_low, boot.ci_high,
                                                         boot.pvalue)
    if boot.ci_low > 0.5 and boot_pair.estimate > 0 and boot_pair.pvalue < alpha:
        res.verdict = SUPPORTED
    elif boot.ci_high < 0.6:
        res.verdict = NOT_SUPPORTED
    else:
        res.verdict = INCONCLUSIVE
    res.detail = (f"AUC(certificate) {auc.auc:.3f} vs AUC(confidence) {paired.auc_b:.3f} for "
                  f"cache-induced among {len(df)} failures ({int(label.sum())} cache-induced) "
                  f"from {boot.n_clusters} sequences; cluster-bootstrap CI and p")
    res.extra = {"confidence_auc": paired.auc_b, "paired_p": boot_pair.pvalue,
                 "delong_ci": (auc.ci_low, auc.ci_high)}
    curves = {"cache-induced: certificate": (cert, label),
              "cache-induced: -mean log-prob": (conf, label)}
    return res, curves


def c3_claim(inputs: ClaimInputs) -> ClaimResult:
    """C3 from the in-loop outcomes."""
    return evaluate_c3(inputs.outcomes, inputs.prereg)


def c4_claim(inputs: ClaimInputs) -> ClaimResult:
    """C4; leaves its ROC inputs as ``artifacts["C4 roc"]``."""
    res, curves = evaluate_c4(inputs.outcomes, inputs.prereg)
    inputs.artifacts["C4 roc"] = curves
    return res


def c6_claim(inputs: ClaimInputs) -> ClaimResult:
    """C6; leaves its ROC inputs as ``artifacts["C6 roc"]``."""
    res, curves = evaluate_c6(inputs.outcomes, inputs.prereg)
    inputs.artifacts["C6 roc"] = curves
    return res
