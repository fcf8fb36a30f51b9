"""C8 from counts: the validity rule's fit and its held-out coverage, never the rows.

A validity rule (:mod:`tracesim.analysis.validity`) certifies a row when its tail size and
Kish n_eff reach thresholds and its largest tail weight stays below one. Every threshold of
the pre-registered grid splits the rows monotonically, so each row is summarised by its
*bucket*: how many of the grid's tail-size thresholds it reaches, how many n_eff thresholds,
how many weight caps it stays under. One DuckDB group-by per (configuration, sequence,
bucket) gives the row count and the sum of the coverage event, and every candidate rule's
certified count, coverage and sequences are sums over the buckets it accepts
(:func:`fit_rules_from_sums`: the selection of :func:`tracesim.analysis.validity.fit_rule`).
The held-out coverage of the chosen (or given) rules is a second group-by per (sequence,
certified) (:func:`heldout_sums`), and its cluster-robust interval the closed form of
:func:`tracesim.analysis.cluster.cluster_proportions` on those sums. Memory: configurations
times sequences times grid buckets, whatever the rows.
"""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
from scipy import stats
from tracesim.analysis.aggregate import notna, quote
from tracesim.analysis.validity import SplitSettings, ValidityRule, choose_rule

__all__ = ["bucket_sums", "fit_rules_from_sums", "heldout_sums", "proportion_from_sums"]


def _double(v: float) -> str:
    """A float as a SQL double literal (parsed as Python wrote it: the same double)."""
    return f"CAST('{float(v)!r}' AS DOUBLE)"


def _reached(column: str, thresholds: list[float], op: str) -> str:
    """SQL: how many ``thresholds`` the row's ``column`` satisfies with ``op`` (a missing or
    NaN value satisfies none, as numpy's comparisons with NaN are false)."""
    c = f"CAST({quote(column)} AS DOUBLE)"
    terms = " + ".join(f"CAST({c} {op} {_double(t)} AS INTEGER)" for t in thresholds) or "0"
    return f"CASE WHEN {notna(column)} THEN {terms} ELSE 0 END"


def bucket_sums(ds, where: str, settings: SplitSettings) -> pd.DataFrame:
    """Per (configuration, sequence, tail bucket, n_eff bucket, weight bucket): ``rows``,
    ``sum_y`` (the coverage event) and ``n_w`` (rows with a largest tail weight)."""
    grid = settings.grid
    tails = sorted(set(map(float, grid["min_tail"])))
    neffs = sorted(set(map(float, grid["min_neff"])))
    caps = sorted(set(map(float, grid.get("max_weight", []))))
    has_w = "max_tail_weight" in ds
    y = f"CAST({quote(settings.coverage_column)} AS DOUBLE)"
    wb = _reached("max_tail_weight", caps, "<=") if has_w else "0"
    nw = f"COUNT(*) FILTER (WHERE {notna('max_tail_weight')})" if has_w else "0"
    return ds.query(
        f"SELECT \"config_id\", \"sequence_id\", tb, nb, wb, COUNT(*) AS rows, SUM(y) AS sum_y, "
        f"{nw} AS n_w FROM (SELECT *, {_reached('tail_size', tails, '>=')} AS tb, "
        f"{_reached('n_eff', neffs, '>=')} AS nb, {wb} AS wb, {y} AS y FROM results "
        f"WHERE {where} AND \"config_id\" IS NOT NULL AND \"sequence_id\" IS NOT NULL) "
        "GROUP BY \"config_id\", \"sequence_id\", tb, nb, wb "
        "ORDER BY \"config_id\", \"sequence_id\", tb, nb, wb")


def _fit_one(cal: pd.DataFrame, settings: SplitSettings, config_id: str,
             calib_ids: list[str]) -> ValidityRule:
    """:func:`tracesim.analysis.validity.fit_rule` on one configuration's calibration buckets."""
    grid = settings.grid
    tails = sorted(set(map(float, grid["min_tail"])))
    neffs = sorted(set(map(float, grid["min_neff"])))
    caps = sorted(set(map(float, grid.get("max_weight", []))))
    rows = cal["rows"].to_numpy(np.int64)
    total = int(rows.sum())
    if total == 0:
        raise ValueError(f"{config_id}: no calibration rows with {settings.coverage_column}")
    has_w = int(cal["n_w"].sum()) > 0
    tb, nb, wb = (cal[c].to_numpy(np.int64) for c in ("tb", "nb", "wb"))
    sum_y = cal["sum_y"].to_numpy(float)
    seq = pd.factorize(cal["sequence_id"])[0]
    weights = grid["max_weight"] if has_w else [None]

    def candidates():
        for mt, ne, mw in itertools.product(grid["min_tail"], grid["min_neff"], weights):
            # a bucket reaches threshold t when it counts more thresholds than those below t
            ok = (tb > tails.index(float(mt))) & (nb > neffs.index(float(ne)))
            if mw is not None:
                ok &= wb >= len(caps) - caps.index(float(mw))
            k = int(rows[ok].sum())
            frac = k / total
            if frac < settings.min_certified or k == 0 or np.unique(seq[ok]).size < 2:
                continue
            yield mt, ne, mw, float(sum_y[ok].sum() / k), frac

    return choose_rule(candidates(), config_id, settings, calib_ids, total)


def fit_rules_from_sums(sums: pd.DataFrame, split: dict[str, bool], settings: SplitSettings,
                        has_weight_column: bool) -> tuple[dict[str, ValidityRule], list[str]]:
    """:func:`tracesim.analysis.validity.fit_rules` from :func:`bucket_sums` (certified rows
    only) and the sequence split; returns (rules, notes) as it does."""
    rules: dict[str, ValidityRule] = {}
    failed: list[str] = []
    for cid, g in sums.groupby("config_id", sort=True):
        ids = sorted(set(map(str, g["sequence_id"])))
        calib = [s for s in ids if split[s]]
        cal = g[g["sequence_id"].astype(str).isin(calib)]
        try:
            rules[str(cid)] = _fit_one(cal, settings, str(cid), calib)
        except ValueError:
            failed.append(str(cid))
    notes: list[str] = []
    if failed:
        notes.append(f"no validity rule could be fitted for {len(failed)} configuration(s) "
                     f"(no candidate certifies rows of two or more calibration sequences), "
                     f"e.g. {failed[0]}")
    if not has_weight_column:
        notes.append("results have no max_tail_weight column: rules use m and n_eff only")
    return rules, notes


def _rule_sql(rules: dict[str, ValidityRule]) -> str:
    """SQL: the row's configuration has a rule and the rule certifies the row
    (:func:`tracesim.analysis.validity.apply_rules`)."""
    if not rules:
        return "FALSE"
    whens = []
    for cid, r in rules.items():
        cond = (f"{notna('tail_size')} AND CAST(\"tail_size\" AS DOUBLE) >= {_double(r.min_tail)}"
                f" AND {notna('n_eff')} AND CAST(\"n_eff\" AS DOUBLE) >= {_double(r.min_neff)}")
        if r.max_weight is not None:
            cond += (f" AND {notna('max_tail_weight')} AND CAST(\"max_tail_weight\" AS DOUBLE) "
                     f"<= {_double(r.max_weight)}")
        whens.append(f"WHEN '{cid.replace(chr(39), chr(39) * 2)}' THEN ({cond})")
    return f"COALESCE(CASE CAST(\"config_id\" AS VARCHAR) {' '.join(whens)} ELSE FALSE END, FALSE)"


def heldout_sums(ds, where: str, rules: dict[str, ValidityRule], held_ids: list[str],
                 coverage_column: str) -> pd.DataFrame:
    """Per (held-out sequence, certified by the rules): ``rows`` and ``sum_y``."""
    import pyarrow as pa

    con = ds.connection()
    con.register("c8_heldout", pa.table({"sequence_id": pa.array(held_ids, pa.string())}))
    try:
        return ds.query(
            f"SELECT \"sequence_id\", ok, COUNT(*) AS rows, SUM(y) AS sum_y FROM (SELECT "
            f"CAST(\"sequence_id\" AS VARCHAR) AS \"sequence_id\", {_rule_sql(rules)} AS ok, "
            f"CAST({quote(coverage_column)} AS DOUBLE) AS y FROM results WHERE {where} AND "
            "CAST(\"sequence_id\" AS VARCHAR) IN (SELECT \"sequence_id\" FROM c8_heldout)) "
            "GROUP BY \"sequence_id\", ok ORDER BY \"sequence_id\", ok")
    finally:
        con.unregister("c8_heldout")


def proportion_from_sums(n_c: np.ndarray, s_c: np.ndarray, alpha: float) -> dict[str, float]:
    """:func:`tracesim.analysis.cluster.cluster_proportions` (one stratum) from per-cluster
    counts ``n_c`` and event sums ``s_c``: ``estimate, ci_low, ci_high, se_logit, n_events,
    n_clusters``."""
    n, s = float(n_c.sum()), float(s_c.sum())
    p = s / n if n > 0 else float("nan")
    k = int((n_c > 0).sum())
    z = stats.norm.ppf(1 - alpha / 2)
    if 0 < p < 1 and k > 1:
        se = float(np.sqrt(((s_c - p * n_c) ** 2).sum()) / (n * p * (1 - p)))
        b = np.log(p / (1 - p))
        lo, hi = 1 / (1 + np.exp(-(b - z * se))), 1 / (1 + np.exp(-(b + z * se)))
    else:
        se = float("nan")
        m, e = int(n), int(round(s))
        lo = stats.beta.ppf(alpha / 2, e, m - e + 1) if e > 0 else 0.0
        hi = stats.beta.ppf(1 - alpha / 2, e + 1, m - e) if e < m else 1.0
    return {"estimate": p, "ci_low": float(lo), "ci_high": float(hi), "se_logit": se,
            "n_events": int(n), "n_clusters": k}
