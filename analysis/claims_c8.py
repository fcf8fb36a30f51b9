"""Claim C8: on held-out sequences, rows the validity rule certifies cover within [0.93, 0.97].

The report computes it from counts (:func:`evaluate_c8_sums`); :func:`evaluate_c8` is the same
claim on rows held in memory.

The rules are fitted on the pre-registered calibration split (:mod:`tracesim.analysis.validity`) or
read
from a rule file (``validity_rules.json`` written by ``tracesim frontier``), which is then
checked: a rule fitted on held-out sequences is refused with :class:`ValidityRuleError`.

Test: two one-sided tests (TOST) of the pooled held-out certified coverage against the
pre-registered interval ``[lo, hi]``, on the logit scale with the cluster-robust (by sequence)
standard error of :func:`tracesim.analysis.cluster.cluster_proportions`; ``p = max(p_lo, p_hi)``.
Supported if ``p < alpha`` (the ``1 - 2 alpha`` interval lies inside ``[lo, hi]``); not
supported if the ``1 - alpha`` interval lies entirely outside; inconclusive otherwise. The
fraction of held-out rows certified is reported next to it. :func:`c8_claim` is the claims
table's entry (:mod:`tracesim.analysis.claim_registry`) and :func:`check_c8` checks C8's own
pre-registration fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats
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
from tracesim.analysis.validity import (
    SplitSettings,
    ValidityRule,
    apply_rules,
    as_text,
    check_rules,
    fit_rules,
    load_rules,
    split_sequences,
)
from tracesim.analysis.validity_sums import proportion_from_sums

__all__ = ["RULES_FILE", "c8_claim", "c8_rows", "c8_where", "check_c8", "evaluate_c8",
           "evaluate_c8_sums"]

#: The validity rules a ``tracesim frontier`` output directory holds.
RULES_FILE = "validity_rules.json"


def c8_rows(results: pd.DataFrame, claim: dict[str, Any]) -> pd.DataFrame:
    """The certified, deployable rows of the configurations C8 compares."""
    # One mask, one copy: filtering step by step would hold a copy of the table per step.
    keep = results["certified"].astype(bool) & results["cert2"].notna()
    for key, value in claim.get("compare", {}).items():
        if key in results:
            keep &= results[key].isin(value if isinstance(value, list) else [value])
    if claim.get("deployable_only", True):
        keep &= (results["deployable"].astype(bool) if "deployable" in results
                 else results["score"] != "oracle")
    # rows read already filtered (c8_read) are returned as they are, not copied
    return results if keep.all() else results[keep]


def c8_where(results, claim: dict[str, Any]) -> str:
    """SQL over a :class:`~tracesim.analysis.aggregate.ResultsDataset`: :func:`c8_rows`' rows
    of the eviction designs that hold the coverage event."""
    from tracesim.analysis.aggregate import notna, sql_in

    settings = SplitSettings.from_claim(claim)
    where = [eviction_where(results), certified_where(), notna(settings.coverage_column)
             if settings.coverage_column in results else "FALSE"]
    for key, value in claim.get("compare", {}).items():
        if key in results:
            where.append(sql_in(key, value if isinstance(value, list) else [value]))
    if claim.get("deployable_only", True):
        where.append("COALESCE(CAST(\"deployable\" AS BOOLEAN), FALSE)"
                     if "deployable" in results else "\"score\" IS DISTINCT FROM 'oracle'")
    return " AND ".join(where)


def evaluate_c8_sums(results, prereg, rules: dict[str, ValidityRule] | None = None
                     ) -> tuple[ClaimResult, dict[str, ValidityRule]]:
    """:func:`evaluate_c8` on a :class:`~tracesim.analysis.aggregate.ResultsDataset` from
    counts (:mod:`tracesim.analysis.validity_sums`): the rules are fitted on per
    (configuration, sequence, threshold bucket) sums and the held-out coverage read from per
    (sequence, certified) sums; the same estimate, interval, verdict and detail.

    Raises
    ------
    ValidityRuleError
        When a given rule was fitted on held-out sequences (or on another split).
    """
    from tracesim.analysis.validity_sums import (
        bucket_sums,
        fit_rules_from_sums,
        heldout_sums,
        proportion_from_sums,
    )

    claim = prereg.claims["C8"]
    alpha = prereg.claim_alpha("C8")
    res = ClaimResult("C8", claim["hypothesis"])
    settings = SplitSettings.from_claim(claim)
    need = {"sequence_id", "config_id", "certified", "cert2", "tail_size", "n_eff"}
    where = c8_where(results, claim) if need <= set(results.columns) else "FALSE"
    seqs = results.query(f"SELECT DISTINCT CAST(\"sequence_id\" AS VARCHAR) AS s FROM results "
                         f"WHERE {where} AND \"sequence_id\" IS NOT NULL")["s"].tolist()
    if not seqs:
        res.detail = "no certified deployable rows of the compared configurations"
        return res, {}
    split = split_sequences(seqs, settings.salt, settings.fraction)
    held_ids = sorted(s for s, c in split.items() if not c)
    notes: list[str] = []
    if rules is None:
        rules, notes = fit_rules_from_sums(bucket_sums(results, where, settings), split,
                                           settings, "max_tail_weight" in results)
    check_rules(rules, settings, held_ids)
    held = heldout_sums(results, where, rules, held_ids, settings.coverage_column)
    n_held = int(held["rows"].sum())
    if n_held == 0 or not rules:
        res.detail = (f"no held-out rows ({len(held_ids)} held-out of {len(split)} sequences) "
                      f"or no fitted rule")
        return res, rules
    ok = held[held["ok"].astype(bool)]
    frac = float(ok["rows"].sum() / n_held)
    return _c8_verdict(res, claim, settings, alpha, rules, notes, frac, n_held, held_ids,
                       len(split), ok["rows"].to_numpy(float), ok["sum_y"].to_numpy(float),
                       proportion_from_sums)


def evaluate_c8(results: pd.DataFrame, prereg,
                rules: dict[str, ValidityRule] | None = None
                ) -> tuple[ClaimResult, dict[str, ValidityRule]]:
    """Evaluate C8; returns the claim and the rules used (fitted here when ``rules`` is None).

    Raises
    ------
    ValidityRuleError
        When a given rule was fitted on held-out sequences (or on another split).
    """
    claim = prereg.claims["C8"]
    alpha = prereg.claim_alpha("C8")
    res = ClaimResult("C8", claim["hypothesis"])
    settings = SplitSettings.from_claim(claim)
    df = c8_rows(eviction_rows(results), claim)  # per-step rows are C9's
    has = df[settings.coverage_column].notna()
    df = df if has.all() else df[has]
    if df.empty:
        res.detail = "no certified deployable rows of the compared configurations"
        return res, {}
    split = split_sequences(df["sequence_id"].unique(), settings.salt, settings.fraction)
    held_ids = sorted(s for s, c in split.items() if not c)
    notes: list[str] = []
    if rules is None:
        rules, notes = fit_rules(df, settings)
    check_rules(rules, settings, held_ids)
    held = df[as_text(df["sequence_id"]).isin(held_ids)]
    if held.empty or not rules:
        res.detail = (f"no held-out rows ({len(held_ids)} held-out of {len(split)} sequences) "
                      f"or no fitted rule")
        return res, rules
    mask = apply_rules(held, rules)
    y = held[settings.coverage_column].to_numpy(float)[mask]
    seq = as_text(held["sequence_id"]).to_numpy()[mask]
    per_seq = pd.DataFrame({"s": seq, "y": y}).groupby("s", sort=True)["y"].agg(["size", "sum"])
    return _c8_verdict(res, claim, settings, alpha, rules, notes, float(mask.mean()),
                       len(held), held_ids, len(split), per_seq["size"].to_numpy(float),
                       per_seq["sum"].to_numpy(float), proportion_from_sums)


def _c8_verdict(res: ClaimResult, claim: dict[str, Any], settings: SplitSettings, alpha: float,
                rules: dict[str, ValidityRule], notes: list[str], frac: float, n_held: int,
                held_ids: list[str], n_sequences: int, n_c: np.ndarray, s_c: np.ndarray,
                proportion) -> tuple[ClaimResult, dict[str, ValidityRule]]:
    """C8's TOST and detail from the held-out certified rows' per-sequence counts ``n_c`` and
    event sums ``s_c`` (``frac``: the share of the ``n_held`` held-out rows certified)."""
    lo, hi = (float(v) for v in claim["interval"])
    res.extra = {"fraction_certified": frac, "heldout_sequences": len(held_ids),
                 "calibration_sequences": n_sequences - len(held_ids),
                 "rules": {k: r.describe() for k, r in rules.items()},
                 "rules_reaching_nominal": int(sum(r.reached for r in rules.values())),
                 "n_rules": len(rules), "notes": notes}
    if n_c.sum() == 0:
        res.detail = (f"the rules certify no held-out row ({n_held} rows, "
                      f"{len(held_ids)} sequences)")
        return res, rules
    ci = proportion(n_c, s_c, alpha)
    ci2 = proportion(n_c, s_c, 2 * alpha)
    res.estimate, res.ci_low, res.ci_high = float(ci["estimate"]), float(ci["ci_low"]), float(
        ci["ci_high"])
    se = float(ci["se_logit"])
    if np.isfinite(se) and se > 0:
        b = np.log(res.estimate / (1 - res.estimate))
        p_lo = stats.norm.sf((b - np.log(lo / (1 - lo))) / se)
        p_hi = stats.norm.cdf((b - np.log(hi / (1 - hi))) / se)
        res.pvalue = float(max(p_lo, p_hi))
    inside = lo <= ci2["ci_low"] and ci2["ci_high"] <= hi
    if inside and np.isfinite(res.pvalue) and res.pvalue < alpha:
        res.verdict = SUPPORTED
    elif res.ci_high < lo or res.ci_low > hi:
        res.verdict = NOT_SUPPORTED
    else:
        res.verdict = INCONCLUSIVE
    res.detail = (f"{settings.coverage_column} of the held-out rows the rules certify: "
                  f"{int(ci['n_events'])} rows of {int(ci['n_clusters'])} held-out sequences; "
                  f"fraction certified {frac:.3f} of {n_held} held-out rows; "
                  f"{res.extra['rules_reaching_nominal']}/{len(rules)} rules reached nominal "
                  f"{settings.nominal} on the {res.extra['calibration_sequences']} calibration "
                  f"sequences; TOST against [{lo}, {hi}]")
    return res, rules


def c8_claim(inputs: ClaimInputs) -> ClaimResult:
    """C8 with the rules of ``inputs.frontier_dir`` when it holds any (checked: a rule fitted
    on held-out sequences raises :class:`ValidityRuleError`), else rules fitted here, from
    counts (:func:`evaluate_c8_sums`)."""
    fdir: Path | None = inputs.frontier_dir
    rules = None
    if fdir is not None and (fdir / RULES_FILE).is_file():
        rules = load_rules(fdir / RULES_FILE)
    c8, _ = evaluate_c8_sums(inputs.results, inputs.prereg, rules)
    if rules is not None:
        c8.detail += f"; rules from {fdir.name}/{RULES_FILE}"
    return c8


def check_c8(c8: dict[str, Any], fail: Fail) -> None:
    """The validity rule's split, interval and candidate grid (see
    ``tracesim.analysis.validity``)."""
    split = c8.get("split")
    if not isinstance(split, dict):
        fail("claims.C8.split", "expected a mapping {unit, salt, calibration_fraction}")
    if split.get("unit", "sequence") != "sequence":
        fail("claims.C8.split.unit", "only 'sequence' is supported")
    if not isinstance(split.get("salt"), str) or not split["salt"]:
        fail("claims.C8.split.salt", "expected a non-empty string")
    f = split.get("calibration_fraction")
    if not isinstance(f, (int, float)) or not 0 < f < 1:
        fail("claims.C8.split.calibration_fraction", f"expected a number in (0, 1), got {f!r}")
    iv = c8.get("interval")
    if (not isinstance(iv, list) or len(iv) != 2
            or not all(isinstance(v, (int, float)) for v in iv) or not 0 < iv[0] < iv[1] < 1):
        fail("claims.C8.interval", f"expected [low, high] with 0 < low < high < 1, got {iv!r}")
    if c8.get("certificate", "primary") not in CERTIFICATES:
        fail("claims.C8.certificate", f"expected one of {list(CERTIFICATES)}")
    if not isinstance(c8.get("nominal"), (int, float)) or not 0 < c8["nominal"] < 1:
        fail("claims.C8.nominal", "expected a number in (0, 1)")
    grid = c8.get("grid", {})
    if not isinstance(grid, dict):
        fail("claims.C8.grid", "expected a mapping of threshold name to a list of numbers")
    for key, vals in grid.items():
        if key not in ("min_tail", "min_neff", "max_weight"):
            fail(f"claims.C8.grid.{key}", "unknown key; expected min_tail, min_neff, max_weight")
        if not isinstance(vals, list) or not vals or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            fail(f"claims.C8.grid.{key}", f"expected a non-empty list of numbers, got {vals!r}")
