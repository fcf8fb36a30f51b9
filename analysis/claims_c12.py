"""C12: Conf-KV's confidence-driven budget against a fixed budget with the same ranking and the
same protected window, at matched mean kept tokens, in the loop (``data/prereg.yaml``).

Evaluated from in-loop outcomes (``tracesim evict --confkv confkv,fixed,streaming``): rows with
``score`` ``confkv`` and ``confkv_fixed`` (and, as references, ``streaming`` and the full
cache), told apart by model through their ``model_id`` column. Per pre-registered model, a
paired TOST over sequences of accuracy (confkv - fixed) with the entry's margin; the claim's
p-value is the larger of the models' (intersection-union). Supported if TOST rejects on every
model; not supported if on some model the (1 - alpha) CI of the difference lies entirely
outside the margin; inconclusive otherwise (a model without rows included).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats
from tracesim.analysis.claims import (
    INCONCLUSIVE,
    NOT_SUPPORTED,
    SUPPORTED,
    ClaimInputs,
    ClaimResult,
)
from tracesim.analysis.equivalence import paired_tost

__all__ = ["c12_claim", "c12_model_rows"]


def _accuracy(df: pd.DataFrame, score: str) -> pd.Series:
    rows = df[df["score"] == score]
    return rows.groupby("sequence_id")["correct"].mean().astype(float)


def _kept(df: pd.DataFrame, score: str) -> float:
    rows = df[df["score"] == score]
    if rows.empty or "kept_tokens_mean" not in rows:
        return math.nan
    return float(rows["kept_tokens_mean"].astype(float).mean())


def c12_model_rows(outcomes: pd.DataFrame, model: str, margin: float, alpha: float
                   ) -> dict[str, Any]:
    """One model's C12 figures: accuracy and mean kept tokens of each configuration, the paired
    difference (confkv - fixed) with its (1 - alpha) CI and the TOST p-value."""
    ids = outcomes["model_id"].astype(str) if "model_id" in outcomes else None
    df = outcomes if ids is None else outcomes[ids.str.startswith(model)]
    out: dict[str, Any] = {"model": model, "sequences": 0}
    if df.empty:
        return out
    conf, fixed = _accuracy(df, "confkv"), _accuracy(df, "confkv_fixed")
    both = pd.concat([conf.rename("confkv"), fixed.rename("fixed")], axis=1).dropna()
    full = df.groupby("sequence_id")["full_correct"].first().astype(float)
    out.update(sequences=len(both), accuracy_confkv=float(conf.mean()) if len(conf) else math.nan,
               accuracy_fixed=float(fixed.mean()) if len(fixed) else math.nan,
               accuracy_streaming=float(_accuracy(df, "streaming").mean()),
               accuracy_full=float(full.mean()),
               kept_confkv=_kept(df, "confkv"), kept_fixed=_kept(df, "confkv_fixed"),
               kept_streaming=_kept(df, "streaming"))
    if len(both) < 2:
        return out
    test = paired_tost(both["confkv"].to_numpy(float), both["fixed"].to_numpy(float), margin,
                       alpha=alpha)
    half = stats.t.ppf(1 - alpha / 2, test.df) * test.se if test.se > 0 else 0.0
    out.update(difference=test.mean_difference, ci_low=test.mean_difference - half,
               ci_high=test.mean_difference + half, tost_p=test.pvalue,
               equivalent=bool(test.pvalue < alpha))
    return out


def c12_claim(inputs: ClaimInputs) -> ClaimResult:
    """C12 as a row of the claims table."""
    claim = inputs.prereg.claims["C12"]
    res = ClaimResult("C12", claim["hypothesis"])
    outcomes = inputs.outcomes
    if outcomes.empty or "score" not in outcomes or not (outcomes["score"] == "confkv").any():
        res.detail = "no Conf-KV in-loop outcomes given (tracesim evict --confkv)"
        return res
    if "model_id" not in outcomes:
        res.detail = "Conf-KV outcomes without a model_id column: the models cannot be told apart"
        return res
    alpha = inputs.prereg.claim_alpha("C12")
    margin = float(claim["margin"])
    models = list(claim.get("compare", {}).get("models", []))
    rows = [c12_model_rows(outcomes, m, margin, alpha) for m in models]
    inputs.artifacts["C12 table"] = rows
    tested = [r for r in rows if "tost_p" in r]
    parts = []
    for r in rows:
        if "tost_p" not in r:
            parts.append(f"{r['model']}: {r['sequences']} paired sequences, not tested")
            continue
        gap = r["kept_fixed"] / r["kept_confkv"] - 1 if r["kept_confkv"] else math.nan
        parts.append(f"{r['model']}: {r['sequences']} sequences, confkv {r['accuracy_confkv']:.3f}"
                     f" vs fixed {r['accuracy_fixed']:.3f} (kept tokens {r['kept_confkv']:.1f} vs "
                     f"{r['kept_fixed']:.1f}, {gap:+.1%}), diff {r['difference']:+.3f} "
                     f"[{r['ci_low']:+.3f}, {r['ci_high']:+.3f}], TOST p {r['tost_p']:.3g}")
    res.detail = f"margin {margin}; " + "; ".join(parts)
    if not tested:
        return res
    worst = max(tested, key=lambda r: r["tost_p"])
    res.estimate, res.ci_low, res.ci_high = worst["difference"], worst["ci_low"], worst["ci_high"]
    outside = any(r["ci_low"] > margin or r["ci_high"] < -margin for r in tested)
    if outside:
        res.verdict = NOT_SUPPORTED
    elif len(tested) == len(models) and all(r["equivalent"] for r in tested):
        res.verdict = SUPPORTED
    else:
        res.verdict = INCONCLUSIVE
    # intersection-union: the claim's p is the larger of the models'; undefined (1) while a
    # pre-registered model has no test
    res.pvalue = worst["tost_p"] if len(tested) == len(models) else 1.0
    res.extra = {"models": {r["model"]: {k: v for k, v in r.items() if k != "model"}
                            for r in rows}}
    if not np.isfinite(res.estimate):
        res.verdict = INCONCLUSIVE
    return res
