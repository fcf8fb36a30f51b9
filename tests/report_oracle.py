"""The report's claims computed in memory with pandas, as they were before the report read
its results through DuckDB: the oracle ``tests/test_report_streaming.py`` holds the streaming
claims to. Test code only: the package computes these from aggregates
(:mod:`tracesim.analysis.aggregate`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from scipy import stats
from tracesim.analysis.claims import (
    INCONCLUSIVE,
    NOT_SUPPORTED,
    SUPPORTED,
    ClaimResult,
    eviction_rows,
)
from tracesim.analysis.claims_c8 import c8_rows
from tracesim.analysis.claims_perstep import pick_configs
from tracesim.analysis.claims_replay import (
    MASS_LABELS,
    NEFF_LABELS,
    TAIL_LABELS,
    _certified,
    _claim,
    tail_bins,
)
from tracesim.analysis.cluster import cluster_proportions, one_sided_bounds
from tracesim.analysis.coverage import cluster_coverage
from tracesim.analysis.equivalence import paired_tost
from tracesim.analysis.plotting import png_bytes, pyplot
from tracesim.analysis.report_figures import policy_labels
from tracesim.analysis.validity import (
    SplitSettings,
    ValidityRule,
    apply_rules,
    as_text,
    check_rules,
    fit_rules,
    split_sequences,
)


def evaluate_c1(results: pd.DataFrame, prereg) -> tuple[ClaimResult, dict[str, Any]]:
    """Certificate coverage, cluster-robust by sequence, stratified by tail size and more."""
    claim, alpha = _claim(prereg, "C1")
    res = ClaimResult("C1", claim["hypothesis"])
    column = {("wald", "primary"): "wald_cov", ("wald", "small_sample"): "wald_t_cov",
              ("satterthwaite", "primary"): "sat_cov",
              ("satterthwaite", "small_sample"): "sat_t_cov"}[
        (claim["primary_event"], claim["certificate"])]
    df = _certified(eviction_rows(results))
    want = claim.get("compare", {})
    if "design" in want:
        df = df[df["design"] == want["design"]]
    df = df[df[column].notna()] if column in df else df.iloc[0:0]
    if df.empty:
        res.detail = f"no certified rows with {column} (primary event {claim['primary_event']})"
        return res, {}
    nominal = float(claim["nominal"])
    threshold = nominal - float(claim.get("margin", 0.0))
    overall = cluster_coverage(df[column].to_numpy(), df["sequence_id"].to_numpy(),
                               nominal=nominal, alpha=alpha)
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
    strata = {
        "tail size": cluster_coverage(df[column], df["sequence_id"], tail_bins(df["tail_size"]),
                                      nominal=nominal, alpha=alpha, order=TAIL_LABELS),
        "Kish n_eff": cluster_coverage(df[column], df["sequence_id"], pd.cut(
            df["n_eff"], [-np.inf, 4, 16, 64, np.inf], right=False,
            labels=NEFF_LABELS).astype(str), nominal=nominal, alpha=alpha, order=NEFF_LABELS),
        "oracle sampled-out mass": cluster_coverage(df[column], df["sequence_id"], pd.cut(
            df["tail_out_mass"], [-np.inf, 0.01, 0.05, 0.2, np.inf], right=False,
            labels=MASS_LABELS).astype(str), nominal=nominal, alpha=alpha, order=MASS_LABELS),
    }
    res.detail = (f"{column} over {overall.n_events[0]} (query, head, config) rows from "
                  f"{overall.n_clusters[0]} sequences; threshold {threshold:.3f}")
    res.extra = {"column": column, "threshold": threshold}
    return res, strata


def evaluate_c2_attention(results: pd.DataFrame, prereg) -> ClaimResult:
    """Paired TOST of relative attention error: Poisson/Hájek vs top-k at equal budget."""
    claim, alpha = _claim(prereg, "C2")
    res = ClaimResult("C2", claim["hypothesis"])
    df = eviction_rows(results)
    keys = ["sequence_id", "score", "budget"]
    # only the columns averaged are copied, not the whole table twice
    rand = df.loc[(df["design"] == "poisson") & (df["correction"] == "hajek"), [*keys, "rel_err"]]
    det = df.loc[df["design"] == "topk", [*keys, "rel_err"]]
    a = rand.groupby(keys)["rel_err"].mean()
    b = det.groupby(keys)["rel_err"].mean()
    cells = pd.concat([a.rename("random"), b.rename("topk")], axis=1).dropna()
    # Cells of one sequence share its tokens: the independent units are the sequences.
    both = cells.groupby(level="sequence_id").mean()
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


def error_budget_figure(results: pd.DataFrame) -> bytes:
    """Mean relative attention error vs budget, one line per (score, design)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    # only the columns drawn and labelled are copied (policy_labels reads the last four)
    df = results.loc[results["budget_unit"] == "fraction", [
        c for c in ("score", "design", "budget", "rel_err", "mixture", "top_fraction",
                    "allocator") if c in results.columns]]
    # Designs that ignore the score give identical rows for every score: one line, one label.
    df["label"] = policy_labels(df)
    for label, g in df.groupby("label"):
        first = g["score"].iloc[0]
        m = g[g["score"] == first].groupby("budget")["rel_err"].mean()
        ax.plot(m.index, m.values, marker="o", label=label)
    ax.set_xlabel("budget (fraction of context)")
    ax.set_ylabel("mean relative error |ô - o| / |o|")
    ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("attention error vs budget")
    return png_bytes(fig)


def head_budget_figure(results: pd.DataFrame) -> bytes:
    """Mean kept tokens per (layer, KV head) for each allocator of the certified policies."""
    plt = pyplot()
    df = results.loc[results["score"] != "full",
                     ["allocator", "layer", "kv_head", "kept_tokens"]]
    allocs = sorted(df["allocator"].dropna().unique()) or ["uniform"]
    fig, axes = plt.subplots(1, len(allocs), figsize=(4.2 * len(allocs), 3.6), squeeze=False)
    pivs = {a: df[df["allocator"] == a].pivot_table(index="layer", columns="kv_head",
                                                    values="kept_tokens", aggfunc="mean")
            for a in allocs}
    # One scale for every panel, from 0: a uniform allocation reads as one flat colour instead
    # of a per-panel stretch of rounding noise.
    vmax = max([float(np.nanmax(p.values)) for p in pivs.values() if p.size] or [1.0])
    for ax, alloc in zip(axes[0], allocs, strict=False):
        piv = pivs[alloc]
        im = ax.imshow(piv.values, aspect="auto", cmap="viridis", vmin=0, vmax=vmax)
        ax.set_xticks(range(piv.shape[1]), [str(c) for c in piv.columns])
        ax.set_xlabel("KV head")
        ax.set_ylabel("layer")
        ax.set_title(f"kept tokens ({alloc})", fontsize=10)
        fig.colorbar(im, ax=ax)
    return png_bytes(fig)


__all__ = ["error_budget_figure", "evaluate_c1", "evaluate_c2_attention", "head_budget_figure"]


def evaluate_c5(results: pd.DataFrame, prereg) -> ClaimResult:
    """C5 as main computed it before its rule ran in DuckDB: pandas pivots of the rows.

    Certificate-gated escalation vs the uniform budget at matched mean memory.

    For base budget b and escalated budget b'' > b' > b from the grid, escalate the units
    (sequence, layer, head, query) with the largest certificates at b until the mean budget is
    b', and compare their error with the uniform budget b' (paired TOST by sequence).
    """
    claim, alpha = _claim(prereg, "C5")
    res = ClaimResult("C5", claim["hypothesis"])
    unit = ["sequence_id", "layer", "head", "query_position", "score"]
    df = _certified(eviction_rows(results))
    df = df[(df["design"] == "poisson") & (df["budget_unit"] == "fraction")
            & (df["allocator"] == "uniform")]
    diffs: list[pd.Series] = []
    for score, sdf in df.groupby("score"):
        budgets = sorted(sdf["budget"].unique())
        for lo, mid, hi in zip(budgets, budgets[1:], budgets[2:], strict=False):
            piv = sdf.pivot_table(index=unit, columns="budget", values=["rel_err", "cert2"])
            piv = piv.dropna()
            if piv.empty:
                continue
            frac = (mid - lo) / (hi - lo)
            cert = piv[("cert2", lo)]
            gated_units = cert.rank(ascending=False, method="first") <= frac * len(cert)
            gated = np.where(gated_units, piv[("rel_err", hi)], piv[("rel_err", lo)])
            frame = pd.DataFrame({"gated": gated, "uniform": piv[("rel_err", mid)].to_numpy(),
                                  "sequence_id": piv.index.get_level_values(0)})
            diffs.append(frame.groupby("sequence_id")[["gated", "uniform"]].mean().assign(
                score=score, budget=mid))
    if not diffs:
        res.detail = ("needs certified poisson rows at three or more fraction budgets "
                      "(uniform allocator)")
        return res
    both = pd.concat(diffs).groupby(level=0)[["gated", "uniform"]].mean()  # per sequence
    if len(both) < 2:
        res.detail = "too few (sequence, budget) pairs"
        return res
    margin = float(claim["margin"])
    test = paired_tost(both["gated"].to_numpy(), both["uniform"].to_numpy(), margin,
                       alpha=alpha)
    res.estimate, res.ci_low, res.ci_high, res.pvalue = (test.mean_difference, test.ci_low,
                                                         test.ci_high, test.pvalue)
    if test.supported:
        res.verdict = SUPPORTED
    elif test.ci_high < -margin:
        res.verdict = NOT_SUPPORTED  # gating is better beyond the margin: it adds something
    else:
        res.verdict = INCONCLUSIVE
    res.detail = (f"rel. error, gated - uniform at matched mean budget, averaged per sequence "
                  f"over scores and budgets, {len(both)} sequences, margin ±{margin}")
    return res


def evaluate_c9(df: pd.DataFrame, claim: dict, alpha: float, claim_id: str = "C9") -> dict:
    """C9 as main computed it from the rows before it read per-sequence sums.

    C9 on held-out results: coverage CI against the interval, paired MSE test vs top-k.

    C11 is the same rule on another model's held-out sequences: ``claim_id`` names the claim in
    messages, and a ``model_id`` field of the entry keeps only that model's rows.
    """
    from scipy import stats

    df, pick = pick_configs(df, claim, claim_id)
    p = df[df.config_id == pick["primary"]]
    b = df[df.config_id == pick["baseline"]]
    lo_iv, hi_iv = claim["interval"]
    # (1 - 2 alpha) two-sided = alpha one-sided on each side
    cov, lo2, hi2 = one_sided_bounds(p["wald_cov"], p["sequence_id"], 1 - alpha)
    _, lo1, hi1 = one_sided_bounds(p["wald_cov"], p["sequence_id"], 1 - alpha / 2)
    mp = p.groupby("sequence_id")["err2"].mean()
    mb = b.groupby("sequence_id")["err2"].mean()
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
    by_kind = {}
    if "attention_kind" in p:
        for kind, g in p.groupby("attention_kind"):
            by_kind[str(kind)] = float(g["wald_cov"].mean())
    return {"claim": claim_id, "coverage": cov, "ci_90": (lo2, hi2), "ci_95": (lo1, hi1),
            "sequences": int(p.sequence_id.nunique()), "rows": len(p),
            "mse_ratio_geomean": float(np.exp(ratio.mean())), "mse_p": float(t.pvalue),
            "verdict": verdict, "primary": pick["primary"], "baseline": pick["baseline"],
            "coverage_by_attention_kind": by_kind}


def c7_rows(results: pd.DataFrame) -> pd.DataFrame:
    """The rows C7 schedules recomputation over (certified decode rows of the Poisson design),
    in the table's order."""
    df = _certified(results)
    return df[(df["design"] == "poisson") & (df["query_role"] == "decode")]


def recompute_curves(results, logprobs: dict[str, np.ndarray] | None,
                     budgets: tuple[float, ...], seed: int = 0) -> pd.DataFrame:
    """Fraction of squared attention error recovered by recomputing a share of (step, head)
    units, per sequence and gate, as main computed it from all rows at once.

    Recomputing a unit restores the full-cache output for that decode step and head, so the
    recovered error is the err2 of the chosen units over the total. ``confidence`` recomputes
    whole decode steps in order of the full-cache token log-prob (lowest first).
    """
    df = c7_rows(results)
    rows = []
    rng = np.random.default_rng(seed)
    for (sid, cfg), g in df.groupby(["sequence_id", "config_id"]):
        err = g["err2"].to_numpy()
        total = err.sum()
        if total <= 0:
            continue
        order = {"certificate": np.argsort(-g["cert2"].to_numpy(), kind="stable"),
                 "random": rng.permutation(len(g))}
        if logprobs is not None and sid in logprobs:
            lp = logprobs[sid]
            step = g["query_position"].to_numpy() - g["prompt_length"].to_numpy() + 1
            conf = np.where((step >= 0) & (step < lp.size), lp[np.clip(step, 0, lp.size - 1)],
                            0.0)
            order["confidence"] = np.argsort(conf, kind="stable")
        for r in budgets:
            k = int(round(r * len(g)))
            for gate, idx in order.items():
                rows.append({"sequence_id": sid, "config_id": cfg, "budget": r, "gate": gate,
                             "recovered": float(err[idx[:k]].sum() / total)})
    return pd.DataFrame(rows)


def evaluate_c8(results: pd.DataFrame, prereg,
                rules: dict[str, ValidityRule] | None = None
                ) -> tuple[ClaimResult, dict[str, ValidityRule]]:
    """C8 as main computed it from the rows (rules fitted on rows, held-out coverage from
    :func:`cluster_proportions`); returns the claim and the rules used.

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
    frac = float(mask.mean())
    lo, hi = (float(v) for v in claim["interval"])
    res.extra = {"fraction_certified": frac, "heldout_sequences": len(held_ids),
                 "calibration_sequences": len(split) - len(held_ids),
                 "rules": {k: r.describe() for k, r in rules.items()},
                 "rules_reaching_nominal": int(sum(r.reached for r in rules.values())),
                 "n_rules": len(rules), "notes": notes}
    if not mask.any():
        res.detail = (f"the rules certify no held-out row ({len(held)} rows, "
                      f"{len(held_ids)} sequences)")
        return res, rules
    y = held[settings.coverage_column].to_numpy(float)[mask]
    seq = as_text(held["sequence_id"]).to_numpy()[mask]
    ci = cluster_proportions(y, seq, alpha=alpha).iloc[0]
    ci2 = cluster_proportions(y, seq, alpha=2 * alpha).iloc[0]
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
                  f"fraction certified {frac:.3f} of {len(held)} held-out rows; "
                  f"{res.extra['rules_reaching_nominal']}/{len(rules)} rules reached nominal "
                  f"{settings.nominal} on the {res.extra['calibration_sequences']} calibration "
                  f"sequences; TOST against [{lo}, {hi}]")
    return res, rules
