"""The results' per-cluster sums through Dask DataFrame, for results on a cluster's filesystem.

:meth:`tracesim.analysis.aggregate.ResultsDataset.sums` runs its ``GROUP BY`` in one DuckDB
process by default. With a scheduler (``--scheduler`` of ``tracesim report``) the same
question is asked of Dask: :func:`dask.dataframe.read_parquet` over the verified part files,
each partition's key expressions, filter and value columns evaluated by the same SQL
(DuckDB on that partition alone, so ``CASE`` bins and ``WHERE`` clauses mean exactly what
they mean in the default engine), then ``groupby(keys).agg`` with count, sum and sum of
squares across partitions. The frame returned is the default engine's: the same columns,
dtypes, group order and null conventions (a sum over no value is missing, as SQL's ``SUM``).

Sums of floats are added in another order than DuckDB's single thread: they agree to the
last few bits (1e-12 relative in the tests), counts exactly.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["LOCAL_SCHEDULERS", "check_scheduler_name", "dask_sums"]

#: Dask's single-machine schedulers; anything else is a distributed scheduler's address.
LOCAL_SCHEDULERS = ("threads", "processes", "synchronous")


def check_scheduler_name(scheduler: str) -> None:
    """Refuse (``UsageError``, exit 2) a scheduler that is neither a local one nor a reachable
    ``tcp://HOST:PORT``, or asked for without Dask installed, before any work."""
    from tracesim.errors import UsageError

    try:
        import dask.dataframe  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"--scheduler {scheduler!r}: needs Dask DataFrame ({exc}); install "
                         "the cluster extra: pip install 'tracesim[cluster]'") from None
    if scheduler in LOCAL_SCHEDULERS:
        return
    from tracesim.sweep.cli import check_scheduler

    check_scheduler(scheduler)


def _referenced(text: str, columns: Sequence[str]) -> list[str]:
    """The results columns a piece of SQL may name (quoted or bare); a superset is harmless."""
    return [c for c in columns
            if '"' + c.replace('"', '""') + '"' in text or re.search(rf"\b{re.escape(c)}\b", text)]


def _partition_values(part: pd.DataFrame, select: str, where: str | None) -> pd.DataFrame:
    """One partition's keys and value columns (DOUBLE, null where missing) under ``where``."""
    import duckdb

    con = duckdb.connect(config={"threads": 1})
    try:
        con.register("results", part)
        sql = f"SELECT {select} FROM results" + (f" WHERE {where}" if where else "")
        return con.sql(sql).df()
    finally:
        con.close()


def dask_sums(files: Sequence[Path], columns: Sequence[str], keys: Sequence[str],
              values: Sequence[str], where: str | None, squares: bool,
              scheduler: str) -> pd.DataFrame:
    """:meth:`ResultsDataset.sums` computed by Dask on ``scheduler`` (a local scheduler's
    name or a distributed scheduler's address); see the module docstring."""
    import dask.dataframe as dd
    from tracesim.analysis.aggregate import notna, quote

    names = [k.rsplit(" AS ", 1)[-1].strip('"') for k in keys]
    exprs = [k if " AS " in k else quote(k) for k in keys]
    select = [*exprs]
    for c in values:
        select.append(f"CASE WHEN {notna(c)} THEN CAST({quote(c)} AS DOUBLE) END "
                      f"AS {quote('v_' + c)}")
    used = _referenced(" ".join([*exprs, *map(quote, values), where or ""]), columns)
    frame = dd.read_parquet([str(f) for f in files], columns=used or list(columns[:1]),
                            dtype_backend="numpy_nullable")
    meta = _partition_values(frame._meta, ", ".join(select), where)
    rows = frame.map_partitions(_partition_values, ", ".join(select), where, meta=meta)
    # a row whose key is null is left out, as SQL's ``WHERE key IS NOT NULL`` and pandas'
    # groupby
    for n in names:
        rows = rows[rows[n].notnull()]
    if squares:
        rows = rows.assign(**{"q_" + c: rows["v_" + c] * rows["v_" + c] for c in values})
    rows = rows.assign(__one=1)
    agg: dict[str, Any] = {"rows": ("__one", "count")}
    for c in values:
        agg["n_" + c] = ("v_" + c, "count")
        agg["sum_" + c] = ("v_" + c, "sum")
        if squares:
            agg["sumsq_" + c] = ("q_" + c, "sum")
    with _scheduled(scheduler):
        if names:
            out = rows.groupby(names, dropna=True).agg(**agg).compute().reset_index()
        else:
            out = rows.compute()
            out = pd.DataFrame({k: [getattr(out[col], how)()] for k, (col, how) in agg.items()})
    return _as_duckdb_frame(out, names, values, squares, meta)


class _scheduled:
    """Dask's scheduler for one computation: a local one by name, or a distributed client."""

    def __init__(self, scheduler: str) -> None:
        self.scheduler = scheduler
        self._client: Any = None
        self._config: Any = None

    def __enter__(self) -> _scheduled:
        import dask

        if self.scheduler in LOCAL_SCHEDULERS:
            self._config = dask.config.set(scheduler=self.scheduler)
        else:
            from distributed import Client

            check_scheduler_name(self.scheduler)
            self._client = Client(self.scheduler, timeout="10s", set_as_default=False)
            self._config = dask.config.set(scheduler=self._client)
        self._config.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._config.__exit__(*exc)
        if self._client is not None:
            self._client.close()


def _as_duckdb_frame(out: pd.DataFrame, names: list[str], values: Sequence[str],
                     squares: bool, meta: pd.DataFrame) -> pd.DataFrame:
    """Dask's result in the default engine's shape: key columns as DuckDB gives them, counts
    int64, a sum over no value missing, groups in key order."""
    cols = [*names, "rows"]
    for c in values:
        cols += ["n_" + c, "sum_" + c] + (["sumsq_" + c] if squares else [])
    out = out.reindex(columns=cols)
    for c in cols[len(names):]:
        if c == "rows" or c.startswith("n_"):
            out[c] = out[c].fillna(0).astype(np.int64)
        else:
            out[c] = out[c].astype("float64")
    for c in values:
        none = out["n_" + c].to_numpy() == 0
        out.loc[none, "sum_" + c] = np.nan
        if squares:
            out.loc[none, "sumsq_" + c] = np.nan
    for n in names:
        kind = meta[n].dtype
        if isinstance(kind, pd.StringDtype) or pd.api.types.is_object_dtype(kind):
            out[n] = out[n].astype(object)
        elif pd.api.types.is_extension_array_dtype(kind):
            numpy_kind = kind.numpy_dtype if hasattr(kind, "numpy_dtype") else object
            out[n] = out[n].to_numpy(dtype=numpy_kind)
    if names:
        out = out.sort_values(names, kind="stable").reset_index(drop=True)
    return out
