"""The per-step table from sums: :func:`tracesim.analysis.perstep.perstep_table` with its cost
columns, computed from a :class:`~tracesim.analysis.aggregate.ResultsDataset` without its rows.

Every column of that table is a function of per-configuration aggregates: the first row's
metadata (score, parameters, design, budget, sinks, window), the row count, the means of
``err2``, ``kept_tokens`` and ``n_positions``, and per (configuration, sequence) the count and
sum of ``wald_cov`` and ``wald_t_cov``, from which the cluster-robust interval of
:func:`tracesim.analysis.cluster.cluster_mean` follows in closed form: with the mean
``m = S / n`` and a cluster's residual sum ``r_c = S_c - m n_c``,
``se = sqrt(k / (k - 1) sum_c r_c^2) / n`` over the ``k`` sequences with a value.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from tracesim.analysis.aggregate import ResultsDataset, quote
from tracesim.analysis.cluster import student_quantile
from tracesim.analysis.perstep import table_row, with_topk_ratio
from tracesim.analysis.perstep_costs import config_costs

__all__ = ["cluster_ci_from_sums", "perstep_costs_table", "pooled_and_by_tables"]

_META = ("score", "score_params", "design", "budget", "sinks", "window")


def cluster_ci_from_sums(n_c: np.ndarray, s_c: np.ndarray) -> tuple[float, float]:
    """Mean and cluster-robust 95 % half-width (Student ``t_{k-1}``) from per-cluster counts
    and sums of the non-missing values (clusters without a value left out), as
    :func:`tracesim.analysis.perstep._cluster_ci` gives them from the rows."""
    keep = n_c > 0
    n_c, s_c = n_c[keep].astype(float), s_c[keep].astype(float)
    n = n_c.sum()
    if n == 0:
        return float("nan"), float("nan")
    m = s_c.sum() / n
    k = int(n_c.size)
    if k < 2:
        return float(m), float("nan")
    r = s_c - m * n_c
    return float(m), student_quantile(0.975, k) * float(np.sqrt(k / (k - 1) * (r**2).sum()) / n)


def perstep_costs_table(ds: ResultsDataset, head_dim: int = 64,
                        where: str | None = None) -> pd.DataFrame:
    """``cost_columns(perstep_table(rows), rows, head_dim)`` of the rows matching ``where``,
    from three DuckDB group-bys (one row per configuration, one per configuration and
    sequence, and the head counts)."""
    cond = f" WHERE {where}" if where else ""
    meta = [c for c in _META if c in ds]
    first = ds.query(f"SELECT CAST(\"config_id\" AS VARCHAR) AS config_id, "
                     f"{', '.join(map(quote, meta))} FROM results{cond} QUALIFY row_number() "
                     "OVER (PARTITION BY \"config_id\" ORDER BY __row) = 1 ORDER BY __row")
    means = ds.sums(["config_id"], _mean_columns(ds), where)
    cells = ds.sums(["config_id", "sequence_id"], ["wald_cov", "wald_t_cov"], where)
    heads = ds.query(f"SELECT count(DISTINCT \"kv_head\") AS kv, count(DISTINCT \"head\") AS h "
                     f"FROM results{cond}")
    return _table_from_sums(first, means, cells, int(heads["kv"].iloc[0]),
                            int(heads["h"].iloc[0]), head_dim)


def _mean_columns(ds: ResultsDataset) -> list[str]:
    return ["err2", "kept_tokens", *(["n_positions"] if "n_positions" in ds else [])]


def _table_from_sums(first: pd.DataFrame, means: pd.DataFrame, cells: pd.DataFrame,
                     n_kv: int, n_heads: int, head_dim: int) -> pd.DataFrame:
    """:func:`perstep_costs_table` from its aggregates: ``first`` (one row per configuration,
    in the order of their first row), ``means`` (:meth:`ResultsDataset.sums` by
    configuration), ``cells`` (by configuration and sequence) and the head counts."""
    values = [c[len("sum_"):] for c in means.columns if c.startswith("sum_")]
    means = means.set_index("config_id")
    G = n_heads // max(n_kv, 1)
    by_config = dict(tuple(cells.groupby("config_id", sort=False)))
    rows, costs = [], []
    for r in first.itertuples(index=False):
        cid = r.config_id
        row = first.loc[first["config_id"] == cid].iloc[0]
        c = by_config[cid]
        n_w, s_w = c["n_wald_cov"].to_numpy(), c["sum_wald_cov"].to_numpy()
        cov, hw = cluster_ci_from_sums(n_w, s_w)
        cov_t, _ = cluster_ci_from_sums(c["n_wald_t_cov"].to_numpy(),
                                        c["sum_wald_t_cov"].to_numpy())
        m = means.loc[cid]
        mean = {v: (m[f"sum_{v}"] / m[f"n_{v}"] if m[f"n_{v}"] > 0 else float("nan"))
                for v in values}
        rows.append(table_row(cid, row, (cov, hw, cov_t), int(m["rows"]), float(mean["err2"]),
                              float(mean["kept_tokens"]), head_dim))
        costs.append(config_costs(row, float(mean["kept_tokens"]),
                                  float(mean.get("n_positions", float("nan"))), n_kv, G,
                                  head_dim))
    table = with_topk_ratio(pd.DataFrame(rows))
    return pd.concat([table.reset_index(drop=True), pd.DataFrame(costs)], axis=1)


def pooled_and_by_tables(ds: ResultsDataset, column: str,
                         head_dim: int = 64) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(perstep_costs_table(ds), by_table_from(ds, column))`` from one set of group-bys
    keyed by ``column`` as well (four scans of the rows, not four per value plus four): the
    pooled aggregates are the per-value ones summed. Rows whose ``column`` is null are in the
    pooled table only, so with any such row the two are computed apart."""
    col = quote(column)
    heads = ds.query(f"SELECT DISTINCT {col} AS v, \"kv_head\" AS kv, \"head\" AS h FROM results")
    if heads["v"].isna().any():
        return perstep_costs_table(ds, head_dim), by_table_from(ds, column, head_dim)
    meta = [c for c in _META if c in ds]
    first = ds.query(f"SELECT {col} AS __by, CAST(\"config_id\" AS VARCHAR) AS config_id, "
                     f"{', '.join(map(quote, meta))}, __row FROM results QUALIFY row_number() "
                     f"OVER (PARTITION BY {col}, \"config_id\" ORDER BY __row) = 1 "
                     "ORDER BY __row")
    means = ds.sums([f"{col} AS __by", "config_id"], _mean_columns(ds))
    cells = ds.sums([f"{col} AS __by", "config_id", "sequence_id"], ["wald_cov", "wald_t_cov"])
    sums_of = [c for c in means.columns if c not in ("__by", "config_id")]
    pooled = _table_from_sums(
        first.drop_duplicates("config_id").drop(columns=["__by", "__row"]),
        means.groupby("config_id", sort=False, as_index=False)[sums_of].sum(),
        cells.groupby(["config_id", "sequence_id"], sort=False, as_index=False)[
            ["n_wald_cov", "sum_wald_cov", "n_wald_t_cov", "sum_wald_t_cov"]].sum(),
        int(heads["kv"].nunique()), int(heads["h"].nunique()), head_dim)
    parts = []
    for value in dict.fromkeys(first["__by"]):
        t = _table_from_sums(
            first.loc[first["__by"] == value].drop(columns=["__by", "__row"]),
            means.loc[means["__by"] == value].drop(columns="__by"),
            cells.loc[cells["__by"] == value].drop(columns="__by"),
            int(heads.loc[heads["v"] == value, "kv"].nunique()),
            int(heads.loc[heads["v"] == value, "h"].nunique()), head_dim)
        t.insert(0, column, value)
        parts.append(t)
    return pooled, pd.concat(parts, ignore_index=True)


def config_order(ds: ResultsDataset, where: str | None = None) -> list[str]:
    """The configuration ids in the order of their first row (pandas' ``drop_duplicates``)."""
    cond = f" WHERE {where}" if where else ""
    return ds.query(f"SELECT CAST(\"config_id\" AS VARCHAR) AS c FROM results{cond} QUALIFY "
                    "row_number() OVER (PARTITION BY \"config_id\" ORDER BY __row) = 1 "
                    "ORDER BY __row")["c"].tolist()


def by_table_from(ds: ResultsDataset, column: str, head_dim: int = 64) -> pd.DataFrame:
    """:func:`tracesim.analysis.perstep.by_table` from sums: one :func:`perstep_costs_table`
    per value of ``column`` (in the order of their first row)."""
    from tracesim.analysis.aggregate import sql_in

    if column not in ds:
        raise ValueError(f"--by {column!r}: not a result column; expected one of "
                         f"{sorted(ds.columns)[:12]}...")
    values = ds.query(f"SELECT {quote(column)} AS v FROM results WHERE {quote(column)} IS NOT "
                      f"NULL QUALIFY row_number() OVER (PARTITION BY {quote(column)} ORDER BY "
                      "__row) = 1 ORDER BY __row")["v"].tolist()
    parts = []
    for value in values:
        t = perstep_costs_table(ds, head_dim, sql_in(column, [value]))
        t.insert(0, column, value)
        parts.append(t)
    return pd.concat(parts, ignore_index=True)


_CERTIFIED = "COALESCE(CAST(\"certified\" AS BOOLEAN), FALSE)"


def _certified_ratios(ds: ResultsDataset) -> dict[str, np.ndarray]:
    """Per certified configuration, ``sqrt(err2 / cert2)`` of its certified rows (one
    configuration's two columns read at a time)."""
    from tracesim.analysis.aggregate import sql_in
    from tracesim.analysis.perstep import _ratio

    out = {}
    for cid in sorted(config_order(ds, _CERTIFIED)):
        g = ds.read(["err2", "cert2"], f"{_CERTIFIED} AND {sql_in('config_id', [cid])}")
        out[cid] = _ratio(g)
    return out


def conformal_columns(ds: ResultsDataset, cal: ResultsDataset,
                      level: float = 0.95) -> tuple[list[float], list[float]]:
    """``kappa`` and ``conf_cov`` per configuration of ``ds`` (in the order of their first
    row), as :func:`tracesim.analysis.perstep.conformal_radius` fits the radius on ``cal``'s
    certified rows and ``main`` measures its coverage on ``ds``'s."""
    radius = {}
    for cid, ratio in _certified_ratios(cal).items():
        r = np.sort(np.where(np.isnan(ratio), np.inf, ratio))
        k = int(np.ceil((r.size + 1) * level)) - 1
        radius[cid] = float(r[min(k, r.size - 1)]) if k < r.size else float("inf")
    cover = {c: float(np.mean(ratio <= radius[c]))
             for c, ratio in _certified_ratios(ds).items() if c in radius}
    order = config_order(ds)
    return ([radius.get(c, np.nan) for c in order], [cover.get(c, np.nan) for c in order])
