"""The certificate frontier: coverage, certified share, error and memory per policy and variant.

One row of the frontier per (policy family, budget, certificate variant, stratum), where a
*family* is a configuration without its budget (score and its parameters, design and its
parameters, correction, allocator, schedule, summary page size). Certificate variants:

- ``wald``: the primary per-coordinate Wald certificate on every certified row (``wald_cov``);
- ``wald_t``: the small-sample variant, ``m/(m-1)`` inflation and a ``t_{m-1}`` quantile
  (``wald_t_cov``);
- ``ruled``: the primary certificate restricted to the rows the validity rule certifies
  (:mod:`tracesim.analysis.validity`), on the **held-out** sequences only;
- ``bound``: the deterministic page-summary bound (``bound_cov``), when the results carry it;
- ``bootstrap``: Poisson-bootstrap coverage (``boot_cov``), when the results carry it;
- ``none``: a family with no certificate at all (top-k without summaries): memory and error only.

Coverage intervals are cluster-robust with sequences as clusters (:mod:`tracesim.analysis.cluster`).
``frac_certified`` is the share of the family's rows (held-out rows for ``ruled``) that get a
certificate from the variant. ``memory`` is the mean over rows of ``kept_tokens`` plus
``summary_tokens`` (0 when absent), in tokens per KV head. ``err_vs_topk`` is the family's mean
``err2`` divided by the mean ``err2`` of top-k **with the same score** (same score parameters,
allocator and schedule; no page summaries when such a top-k exists) at the same memory, read off
the top-k budget curve by linear interpolation of ``log(err2)`` in memory; it is null when the
memory lies outside the top-k curve's range (more than 2 % beyond its ends) — no extrapolation.
``tightness_median`` / ``tightness_p90`` are the median and 90th percentile over rows with
``err2 > 0`` of ``sqrt(bound2 / err2)``.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd
from tracesim.analysis.claims_replay import NEFF_LABELS, TAIL_LABELS, tail_bins
from tracesim.analysis.cluster import cluster_proportions
from tracesim.analysis.validity import ValidityRule, apply_rules, as_text, split_sequences

__all__ = ["AIM", "OPTIONAL_COLUMNS", "REQUIRED_COLUMNS", "STRATA", "aim_table",
           "family_labels", "finish_frontier", "frontier_rows", "frontier_table"]

REQUIRED_COLUMNS = (
    "sequence_id", "task", "layer", "head", "query_role", "config_id", "score", "score_params",
    "design", "correction", "budget", "budget_unit", "allocator", "schedule", "mixture", "floor",
    "certified", "err2", "rel_err", "cert2", "tail_size", "n_eff", "wald_cov", "wald_t_cov",
    "kept_tokens")
OPTIONAL_COLUMNS = ("store", "max_tail_weight", "deployable", "bound2", "bound_cov",
                    "summary_tokens", "summary_page", "boot_cov", "seed", "n_seeds",
                    # the per-step section's costs
                    # (tracesim.analysis.frontier_cli.perstep_costs_markdown)
                    "kv_head", "n_positions", "sinks", "window")
#: Strata kinds, in report order; ``store`` only when there are several stores.
STRATA = ("m", "n_eff", "layer", "head", "query_role", "task", "store")
#: The issue's aim at a 25 % budget.
AIM = {"budget": 0.25, "coverage": (0.93, 0.97), "certified": 0.8, "err_vs_topk": 1.0}
_FAMILY = ["score", "score_params", "design", "mixture", "floor", "correction", "allocator",
           "schedule", "summary_page"]


def _fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _params(text: Any) -> dict[str, Any]:
    """A ``score_params`` cell of a results table (from a stranger: bounded, a JSON object)."""
    from tracesim.safeio import loads_json

    if not isinstance(text, str) or not text:
        return {}
    doc = loads_json(text, "results: score_params", max_depth=4)
    if not isinstance(doc, dict):
        raise ValueError(f"results: score_params is {text[:80]!r}, expected a JSON object")
    return doc


def family_labels(df: pd.DataFrame) -> pd.Series:
    """A short readable label per row's family (score parameters shown only where they vary)."""
    keys = [c for c in _FAMILY if c in df]
    fam = df[keys].drop_duplicates()
    varying: dict[str, set[str]] = {}
    for score, g in fam.groupby("score"):
        params = [_params(p) for p in g["score_params"]]
        allk = {k for p in params for k in p}
        varying[score] = {k for k in allk if len({json.dumps(p.get(k)) for p in params}) > 1}
    labels = {}
    for row in fam.itertuples(index=False):
        r = row._asdict()
        p = _params(r["score_params"])
        sp = ",".join(f"{k}={_fmt(p[k])}" for k in sorted(varying.get(r["score"], ())) if k in p)
        lab = r["score"] + (f"[{sp}]" if sp else "") + "/" + r["design"]
        inner = []
        if pd.notna(r.get("mixture")) and r["design"] != "topk":
            inner.append(f"λ={r['mixture']:g}")
        if pd.notna(r.get("floor")) and r.get("floor", 0) > 0:
            inner.append(f"floor={r['floor']:g}")
        lab += f"({','.join(inner)})" if inner else ""
        if r["correction"] == "none" and r["design"] != "topk":
            lab += "·uncorrected"
        if r["allocator"] != "uniform":
            lab += f"·{r['allocator']}"
        if r["schedule"] != "oneshot":
            lab += f"·{r['schedule']}"
        if pd.notna(r.get("summary_page")) and r.get("summary_page", 0) > 0:
            lab += f"·P{int(r['summary_page'])}"
        labels[tuple(r[k] if not (isinstance(r[k], float) and np.isnan(r[k])) else None
                     for k in keys)] = lab
    codes = df.groupby(keys, dropna=False, sort=False).ngroup()
    first = df.loc[~codes.duplicated(), keys]
    names = {int(codes[i]): labels[tuple(None if (isinstance(v, float) and np.isnan(v)) else v
                                         for v in first.loc[i])] for i in first.index}
    return codes.map(names).rename("family")


def _strata_labels(df: pd.DataFrame, kind: str) -> pd.Series:
    if kind == "m":
        return tail_bins(df["tail_size"]).astype("category")
    if kind == "n_eff":
        return pd.cut(df["n_eff"], [-np.inf, 4, 16, 64, np.inf], right=False,
                      labels=NEFF_LABELS).astype(str).astype("category")
    return df[kind].astype(str).astype("category")


def _order(kind: str, names: list[str]) -> list[str]:
    if kind == "m":
        return [s for s in TAIL_LABELS if s in names]
    if kind == "n_eff":
        return [s for s in NEFF_LABELS if s in names]
    if kind in ("layer", "head"):
        return sorted(names, key=lambda s: int(s) if s.lstrip("-").isdigit() else 1 << 30)
    return sorted(names)


def _coverage_rows(y: np.ndarray, scope: pd.DataFrame, defined: np.ndarray, kinds: list[str],
                   alpha: float) -> list[dict[str, Any]]:
    """Overall and per-stratum coverage of the events ``y[defined]`` among ``scope``'s rows."""
    rows = []
    seq = scope["_seq"].to_numpy()
    for kind in ["all", *kinds]:
        labels = (pd.Series(np.full(len(scope), "all", dtype=object)) if kind == "all"
                  else scope[f"_s_{kind}"].reset_index(drop=True))
        total = labels.value_counts()
        if not defined.any():
            continue
        res = cluster_proportions(y[defined], seq[defined], labels[defined], alpha=alpha)
        for name in _order(kind, list(res.index)):
            r = res.loc[name]
            rows.append({"stratum_kind": kind, "stratum": name, "coverage": r["estimate"],
                         "ci_low": r["ci_low"], "ci_high": r["ci_high"],
                         "n_rows": int(r["n_events"]), "n_sequences": int(r["n_clusters"]),
                         "frac_certified": r["n_events"] / total[name]})
    return rows


def _tightness(g: pd.DataFrame) -> tuple[float, float]:
    if "bound2" not in g:
        return np.nan, np.nan
    ok = g["bound2"].notna() & (g["err2"] > 0)
    if not ok.any():
        return np.nan, np.nan
    t = np.sqrt(g.loc[ok, "bound2"].to_numpy(float) / g.loc[ok, "err2"].to_numpy(float))
    return float(np.median(t)), float(np.quantile(t, 0.9))


def frontier_table(df: pd.DataFrame, *, rules: dict[str, ValidityRule] | None = None,
                   salt: str | None = None, fraction: float | None = None,
                   alpha: float = 0.05) -> tuple[pd.DataFrame, list[str]]:
    """Compute the frontier (see the module docstring); returns (table, notes).

    Parameters
    ----------
    df : pandas.DataFrame
        Replay / sweep results with at least :data:`REQUIRED_COLUMNS`.
    rules : dict, optional
        Fitted validity rules by ``config_id``; with ``salt`` and ``fraction`` (the
        pre-registered split) they give the ``ruled`` variant on held-out sequences. Check them
        with :func:`tracesim.analysis.validity.check_rules` first.
    alpha : float
        Level of the cluster-robust intervals.
    """
    rows, notes = frontier_rows(df, rules=rules, salt=salt, fraction=fraction, alpha=alpha)
    return finish_frontier(rows), notes


def frontier_rows(df: pd.DataFrame, *, rules: dict[str, ValidityRule] | None = None,
                  salt: str | None = None, fraction: float | None = None,
                  alpha: float = 0.05, families: dict[str, str] | None = None,
                  kinds: list[str] | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """The frontier's rows of :func:`frontier_table`, before :func:`finish_frontier`.

    A streaming reader calls it once per family's rows (all configurations of one family
    label): ``families`` maps every ``config_id`` to its label (:func:`family_labels` of the
    whole results) and ``kinds`` gives the strata (``store`` only when the whole results hold
    several), so a part computes what the whole table would for its groups.
    """
    missing = [c for c in REQUIRED_COLUMNS if c not in df]
    if missing:
        raise ValueError(f"results lack the columns {missing}")
    notes = []
    for col, what in (("max_tail_weight", "validity rule uses m and n_eff only"),
                      ("deployable", "oracle rows marked non-deployable by the score name"),
                      ("bound_cov", "no bound variant, no tightness"),
                      ("summary_tokens", "memory = kept tokens only"),
                      ("boot_cov", "no bootstrap variant")):
        if col not in df:
            notes.append(f"no `{col}` column: {what}")
    df = df[df["score"] != "full"].copy()
    df["family"] = (family_labels(df) if families is None
                    else as_text(df["config_id"]).map(families).to_numpy())
    df["_memory"] = df["kept_tokens"] + (df["summary_tokens"].fillna(0.0)
                                         if "summary_tokens" in df else 0.0)
    if kinds is None:
        kinds = [k for k in STRATA
                 if k != "store" or ("store" in df and df["store"].nunique() > 1)]
    df["_seq"] = pd.factorize(df["sequence_id"])[0]
    for kind in kinds:
        df[f"_s_{kind}"] = _strata_labels(df, kind)
    if rules:
        if salt is None or fraction is None:
            raise ValueError("rules need the pre-registered split (salt, fraction)")
        split = split_sequences(df["sequence_id"].unique(), salt, fraction)
        df["_heldout"] = df["sequence_id"].astype(str).map(split).eq(False).to_numpy()
        df["_ruled"] = apply_rules(df, rules)
    else:
        notes.append("no validity rule: no `ruled` variant")
    out = []
    for (fam, budget), g in df.groupby(["family", "budget"], sort=True):
        first = g.iloc[0]
        base = {"family": fam, "score": first["score"], "design": first["design"],
                "budget": float(budget), "budget_unit": first["budget_unit"],
                "config_id": first["config_id"],
                "deployable": bool(g["deployable"].all()) if "deployable" in g
                else first["score"] != "oracle",
                "memory": float(g["_memory"].mean()), "err2": float(g["err2"].mean()),
                "rel_err": float(g["rel_err"].mean()),
                "summary_tokens": float(g["summary_tokens"].mean()) if "summary_tokens" in g
                else np.nan}
        base["tightness_median"], base["tightness_p90"] = _tightness(g)
        cert = (g["certified"].astype(bool) & g["cert2"].notna()).to_numpy()
        variants: list[tuple[str, np.ndarray, pd.DataFrame, np.ndarray]] = []
        if cert.any():
            for name, col in (("wald", "wald_cov"), ("wald_t", "wald_t_cov"),
                              ("bootstrap", "boot_cov")):
                if col in g:
                    y = g[col].to_numpy(float)
                    variants.append((name, y, g, cert & ~np.isnan(y)))
            if rules:
                sel = g["_heldout"].to_numpy()
                h = g[sel]
                y = h["wald_cov"].to_numpy(float)
                ok = h["_ruled"].to_numpy() & cert[sel] & ~np.isnan(y)
                variants.append(("ruled", y, h, ok))
        if "bound_cov" in g and g["bound_cov"].notna().any():
            y = g["bound_cov"].astype(float).to_numpy()
            variants.append(("bound", y, g, ~np.isnan(y)))
        if not variants:
            out.append({**base, "variant": "none", "stratum_kind": "all", "stratum": "all",
                        "n_rows": len(g), "n_sequences": g["sequence_id"].nunique(),
                        "frac_certified": 0.0})
        for name, y, scope, defined in variants:
            rows = _coverage_rows(y, scope, defined, kinds, alpha)
            if not rows:
                out.append({**base, "variant": name, "stratum_kind": "all", "stratum": "all",
                            "n_rows": 0, "n_sequences": 0, "frac_certified": 0.0})
            out.extend({**base, "variant": name, **r} for r in rows)
    return out, notes


def finish_frontier(out: list[dict[str, Any]]) -> pd.DataFrame:
    """The frontier table from its rows (in (family, budget) order): ``err_vs_topk`` read off
    every family's top-k curve, the columns in order."""
    table = pd.DataFrame(out)
    table["err_vs_topk"] = _versus_topk(table)
    cols = ["family", "score", "design", "budget", "budget_unit", "variant", "stratum_kind",
            "stratum", "deployable", "coverage", "ci_low", "ci_high", "n_rows", "n_sequences",
            "frac_certified", "memory", "summary_tokens", "err2", "rel_err", "err_vs_topk",
            "tightness_median", "tightness_p90", "config_id"]
    for c in cols:
        if c not in table:
            table[c] = np.nan
    return table[cols]


def _topk_key(fam_row: pd.Series) -> tuple[tuple, str]:
    """(score part, allocator, schedule) of the config id, and its page suffix."""
    cfg = str(fam_row["config_id"]).split("|")
    # config id: score(...)|design(...)|correction|allocator:budget|schedule[|pages=P]
    alloc = cfg[3].split(":")[0] if len(cfg) > 3 else ""
    pages = cfg[5] if len(cfg) > 5 else ""
    return (cfg[0], alloc, cfg[4] if len(cfg) > 4 else ""), pages


def _versus_topk(table: pd.DataFrame) -> np.ndarray:
    """err2 / interpolated top-k err2 at equal memory (see the module docstring).

    The reference is top-k without page summaries when the table has it for the score, else
    top-k with the same page size (both sides then pay for their summaries in memory).
    """
    res = np.full(len(table), np.nan)
    if table.empty:
        return res
    first = table.drop_duplicates(["family", "budget"])
    topk = first[first["design"] == "topk"]
    curves: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    for (key, pages), g in topk.groupby([topk.apply(lambda r: _topk_key(r)[0], axis=1),
                                         topk.apply(lambda r: _topk_key(r)[1], axis=1)]):
        g = g.groupby("memory", as_index=False)["err2"].mean().sort_values("memory")
        curves[(key, pages)] = (g["memory"].to_numpy(float), g["err2"].to_numpy(float))
    for i, (_, r) in enumerate(table.iterrows()):
        key, pages = _topk_key(r)
        curve = curves.get((key, "")) or curves.get((key, pages))
        if curve is None or not np.isfinite(r["memory"]):
            continue
        mem, err = curve
        lo, hi = mem[0] * 0.98, mem[-1] * 1.02
        if not lo <= r["memory"] <= hi or (err <= 0).any():
            continue
        ref = np.exp(np.interp(r["memory"], mem, np.log(err))) if mem.size > 1 else err[0]
        res[i] = r["err2"] / ref
    return res


def aim_table(table: pd.DataFrame) -> pd.DataFrame:
    """The issue's aim per family at the 25 % budget: held-out ruled coverage within
    [0.93, 0.97], >= 80 % of rows certified, error no worse than top-k at equal memory."""
    t = table[(table["stratum_kind"] == "all") & (table["variant"] == "ruled")
              & np.isclose(table["budget"], AIM["budget"])]
    lo, hi = AIM["coverage"]
    out = t[["family", "deployable", "coverage", "ci_low", "ci_high", "frac_certified",
             "err_vs_topk", "memory"]].copy()
    out["coverage_ok"] = out["coverage"].between(lo, hi)
    out["certified_ok"] = out["frac_certified"] >= AIM["certified"]
    out["error_ok"] = out["err_vs_topk"] <= AIM["err_vs_topk"]
    out["aim_met"] = out["coverage_ok"] & out["certified_ok"] & out["error_ok"] & out[
        "deployable"].astype(bool)
    return out.reset_index(drop=True)
