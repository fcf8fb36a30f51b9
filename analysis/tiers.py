"""C7 in bytes and time: fetch schedulers compared over ``tracesim tiers`` results.

Input: ``tiers.parquet`` as a pandas DataFrame (columns in ``docs/tiers.md``). The independent
units are sequences: every statistic is first summed within a sequence (its layers, heads and
steps share one context), then compared across sequences.

* :func:`scheduler_curves` — per (sequence, policy, scheduler, fetch budget): the share of the
  eviction error recovered ``1 - sum err2_after / sum err2_before``, bytes moved (also as a
  share of refetching every evicted page), modelled stall, and the error recovered per GB and
  per modelled millisecond.
* :func:`compare_schedulers` — paired one-sided tests (sign-flip permutation over sequences,
  exact for up to 16 sequences, and the t-test) of one scheduler against others at equal
  budgets, Holm-adjusted.
* :func:`tiers_figure` — error against bytes moved and against modelled stall, per scheduler.
"""

from __future__ import annotations

from itertools import product
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats
from tracesim.analysis.multiplicity import holm
from tracesim.analysis.plotting import png_bytes, pyplot

__all__ = ["compare_schedulers", "curves_tables", "read_scheduler_curves", "scheduler_curves",
           "tiers_figure", "tiers_tables"]

_KEYS = ["sequence_id", "config_id", "scheduler", "fetch_budget"]


def scheduler_curves(df: pd.DataFrame) -> pd.DataFrame:
    """Per (sequence, config, scheduler, fetch budget) totals and recovered share."""
    keys = ["sequence_id", "config_id", "scheduler", "fetch_budget"]
    g = df.groupby(keys, sort=True)
    out = g.agg(err2_before=("err2_before", "sum"), err2_after=("err2_after", "sum"),
                bytes_moved=("bytes_moved", "sum"), stall_ms=("stall_ms", "sum"),
                fetch_ms=("fetch_ms", "sum")).reset_index()
    # evicted bytes and stall are per KV head / per layer: count each (layer, kv_head, step) once
    ev = (df.drop_duplicates(keys + ["layer", "kv_head", "step"])
          .groupby(keys)["evicted_bytes"].sum().rename("evicted_bytes"))
    st = (df.drop_duplicates(keys + ["layer", "step"])
          .groupby(keys)[["stall_ms", "fetch_ms"]].sum())
    out = out.drop(columns=["stall_ms", "fetch_ms"]).merge(ev.reset_index(), on=keys)
    return _with_shares(out.merge(st.reset_index(), on=keys))


def _with_shares(out: pd.DataFrame) -> pd.DataFrame:
    """The per-unit totals with the recovered share, bytes share and recovery per GB and
    per modelled millisecond."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out["recovered"] = 1.0 - out["err2_after"] / out["err2_before"]
        out["bytes_share"] = out["bytes_moved"] / out["evicted_bytes"]
        gained = out["err2_before"] - out["err2_after"]
        out["recovered_per_gb"] = np.where(out["bytes_moved"] > 0,
                                           gained / (out["bytes_moved"] / 1e9), np.nan)
        out["recovered_per_ms"] = np.where(out["stall_ms"] > 0, gained / out["stall_ms"],
                                           np.nan)
    return out


def _one_sided_p(d: np.ndarray) -> tuple[float, float]:
    """(t-test p, sign-flip permutation p) for mean(d) > 0."""
    d = d[np.isfinite(d)]
    if d.size < 2:
        return np.nan, np.nan
    if np.all(d == d[0]):
        p = 0.0 if d[0] > 0 else 1.0
        return p, p
    t = stats.ttest_1samp(d, 0.0, alternative="greater").pvalue
    n = d.size
    obs = d.mean()
    if n <= 16:  # exact: every sign pattern (the observed one included)
        signs = np.array(list(product((1.0, -1.0), repeat=n)))
        perm = (signs * np.abs(d)).mean(axis=1)
        return float(t), float((perm >= obs - 1e-15).mean())
    # Monte Carlo with a fixed seed; (k + 1) / (N + 1) keeps the p-value valid (never 0)
    rng = np.random.default_rng(0)
    signs = rng.choice((1.0, -1.0), size=(20000, n))
    perm = (signs * np.abs(d)).mean(axis=1)
    return float(t), float(((perm >= obs - 1e-15).sum() + 1) / (perm.size + 1))


def compare_schedulers(curves: pd.DataFrame, scheduler: str = "certificate",
                       against: tuple[str, ...] = ("random", "confidence"),
                       budgets: tuple[float, ...] | None = None,
                       alpha: float = 0.05) -> pd.DataFrame:
    """Paired comparisons of ``scheduler`` against each of ``against`` at equal fetch budgets.

    For each (config, budget, other) the difference in recovered share is formed per sequence;
    the table gives its mean, the one-sided p-values (t and sign-flip permutation) and the
    Holm-adjusted permutation p-value over all rows.
    """
    rows = []
    cur = curves if budgets is None else curves[curves["fetch_budget"].isin(budgets)]
    cur = cur[(cur["fetch_budget"] > 0) & (cur["fetch_budget"] < 1)]
    piv = cur.pivot_table(index=["config_id", "fetch_budget", "sequence_id"],
                          columns="scheduler", values="recovered")
    if scheduler not in piv:
        return pd.DataFrame(columns=["config_id", "fetch_budget", "other", "n_sequences",
                                     "mean_diff", "p_t", "p_perm", "p_holm", "reject"])
    for (cfg, b), block in piv.groupby(level=["config_id", "fetch_budget"]):
        for other in against:
            if other not in block:
                continue
            d = (block[scheduler] - block[other]).to_numpy()
            p_t, p_perm = _one_sided_p(d)
            rows.append({"config_id": cfg, "fetch_budget": b, "other": other,
                         "n_sequences": int(np.isfinite(d).sum()),
                         "mean_diff": float(np.nanmean(d)), "p_t": p_t, "p_perm": p_perm})
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    adj = holm({str(i): p for i, p in enumerate(table["p_perm"])}, alpha=alpha)
    table["p_holm"] = [adj.get(str(i), (np.nan, False))[0] for i in range(len(table))]
    table["reject"] = [adj.get(str(i), (np.nan, False))[1] for i in range(len(table))]
    return table


def tiers_figure(curves: pd.DataFrame, path: str | Path | None = None) -> bytes:
    """Error against bytes moved and against modelled stall, one line per scheduler.

    Returns the PNG bytes (also written to ``path`` when given).
    """
    plt = pyplot()
    agg = (curves.groupby(["scheduler", "fetch_budget"])
           [["err2_before", "err2_after", "bytes_moved", "evicted_bytes", "stall_ms"]].sum()
           .reset_index())
    agg["remaining"] = agg["err2_after"] / agg["err2_before"]
    agg["bytes_share"] = agg["bytes_moved"] / agg["evicted_bytes"]
    n_seq = curves["sequence_id"].nunique()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, g in agg.groupby("scheduler"):
        g = g.sort_values("fetch_budget")
        style = "--" if name == "oracle" else "-"
        axes[0].plot(g["bytes_share"], g["remaining"], style, marker="o", label=name)
        axes[1].plot(g["stall_ms"] / max(1, n_seq), g["remaining"], style, marker="o",
                     label=name)
    axes[0].set_xlabel("bytes moved / bytes of every evicted page")
    axes[1].set_xlabel("modelled stall per sequence (ms, summed over layers and steps)")
    for ax in axes:
        ax.set_ylabel("remaining error share (sum err2 after / before)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[1].set_xscale("symlog", linthresh=1e-3)
    axes[1].set_xlim(left=0)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Fetch schedulers over {n_seq} sequences (oracle dashed: not deployable)",
                 fontsize=10)
    fig.tight_layout()
    png = png_bytes(fig)
    if path is not None:
        Path(path).write_bytes(png)
    return png


def read_scheduler_curves(path: str | Path, memory_limit: str = "256MB") -> pd.DataFrame:
    """:func:`scheduler_curves` of a ``tiers.parquet`` without loading it: DuckDB reads the
    file's 11 columns it needs batch by batch and aggregates under ``memory_limit`` (spilling
    beyond it), one thread so the float sums add in the file's order. Each (layer, KV head,
    step)'s evicted bytes and each (layer, step)'s stall and fetch time come from its first row
    in the file, as ``drop_duplicates`` keeps; rows with a missing key are left out, as
    ``groupby``. Only the result, one row per (sequence, config, scheduler, budget), is held."""
    import tempfile

    import duckdb

    src = "'" + str(path).replace("'", "''") + "'"
    keys = ", ".join(_KEYS)
    with tempfile.TemporaryDirectory(prefix="tracesim-tiers-") as spill:
        con = duckdb.connect(config={"memory_limit": memory_limit, "threads": 1,
                                     "temp_directory": spill})
        try:
            con.execute("SET enable_progress_bar = false")  # the report's output is its own
            where = " AND ".join([*(f"{k} IS NOT NULL" for k in _KEYS),
                                  "NOT isnan(fetch_budget)"])
            sql = (
                f"WITH r AS (SELECT {keys}, layer, kv_head, step, err2_before, err2_after, "
                "bytes_moved, evicted_bytes, stall_ms, fetch_ms, file_row_number AS n "
                f"FROM read_parquet({src}, file_row_number = true) WHERE {where}), "
                # per (layer, KV head, step): sums, and the first row's evicted bytes, stall
                f"h AS (SELECT {keys}, layer, step, min(n) AS n, "
                f"{_sum('err2_before')} AS eb, {_sum('err2_after')} AS ea, "
                f"{_sum('bytes_moved')} AS bm, arg_min_null(evicted_bytes, n) AS ev, "
                "arg_min_null(stall_ms, n) AS st, arg_min_null(fetch_ms, n) AS ft "
                f"FROM r GROUP BY {keys}, layer, kv_head, step), "
                # per (layer, step): the first row's stall and fetch time
                f"s AS (SELECT {keys}, {_sum('eb')} AS eb, {_sum('ea')} AS ea, "
                f"{_sum('bm')} AS bm, {_sum('ev')} AS ev, arg_min_null(st, n) AS st, "
                f"arg_min_null(ft, n) AS ft FROM h GROUP BY {keys}, layer, step) "
                f"SELECT {keys}, {_sum('eb')} AS err2_before, {_sum('ea')} AS err2_after, "
                f"{_sum('bm')} AS bytes_moved, {_sum('ev')} AS evicted_bytes, "
                f"{_sum('st')} AS stall_ms, {_sum('ft')} AS fetch_ms "
                f"FROM s GROUP BY {keys} ORDER BY {keys}")
            table = con.sql(sql).to_arrow_table()
        finally:
            con.close()
    return _with_shares(table.to_pandas())


def _sum(column: str) -> str:
    """SQL: pandas' ``sum`` of a float column (missing values and NaN skipped, 0 for none)."""
    return f"COALESCE(sum({column}) FILTER (WHERE NOT isnan({column})), 0)"


def tiers_tables(df: pd.DataFrame) -> tuple[str, str]:
    """Text tables for the report: recovered share per scheduler and budget, and the paired
    tests of the certificate schedulers against ``random`` and ``confidence``."""
    return curves_tables(scheduler_curves(df))


def curves_tables(curves: pd.DataFrame) -> tuple[str, str]:
    """:func:`tiers_tables` from the curves (:func:`scheduler_curves` or
    :func:`read_scheduler_curves`)."""
    agg = curves.groupby(["scheduler", "fetch_budget"]).agg(
        recovered=("recovered", "mean"), bytes_share=("bytes_share", "mean"),
        stall_ms=("stall_ms", "mean"), recovered_per_gb=("recovered_per_gb", "mean"),
        recovered_per_ms=("recovered_per_ms", "mean"))
    tests = []
    for s in ("certificate_bound", "certificate_page", "certificate", "bound"):
        t = compare_schedulers(curves, s, ("random", "confidence"))
        if not t.empty:
            t.insert(0, "scheduler", s)
            tests.append(t.drop(columns=["config_id"]))
    test_text = (pd.concat(tests).to_string(index=False, float_format=lambda x: f"{x:.3g}")
                 if tests else "no certified base policy: no scheduler comparison")
    return agg.to_string(float_format=lambda x: f"{x:.3g}"), test_text
