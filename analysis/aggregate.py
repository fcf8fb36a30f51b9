"""The report's results reader: DuckDB over the verified results files, never the whole table.

:class:`ResultsDataset` opens a sweep's results dataset (``results/manifest.json`` and its
parts, verified part by part) or the single results file of replay and earlier sweeps, and
answers two kinds of question with SQL run by DuckDB under a memory limit:

* :meth:`ResultsDataset.sums` — per-cluster sufficient statistics: ``GROUP BY`` the keys a
  consumer needs (configuration, sequence, layer, head, ...) with the count, sum and sum of
  squares of columns (the count of non-missing values is the coverage count for a 0/1 event).
  A claim's estimate and its cluster-robust interval are functions of these sums
  (:func:`coverage_from_sums`).
* :meth:`ResultsDataset.read` — a filtered, projected read (``WHERE ... `` on a few columns)
  for consumers whose rule needs rows (C5's per-unit escalation, C7's rankings, C8's validity
  rule, C9's paired test), in the table's order.

Why DuckDB: its hash aggregation spills to disk when it exceeds ``memory_limit``, it reads
Parquet column by column and pushes filters into the scan, and one process does it (no
scheduler to start). Memory is then bounded by the limit plus the groups a query returns, not
by the rows. ``threads`` is 1 by default: a sum of floats depends on the order its rows are
added in, and one thread adds them in the table's order on every machine.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

__all__ = ["DEFAULT_MEMORY_LIMIT", "DEFAULT_THREADS", "ResultsDataset", "coverage_from_sums",
           "notna", "open_results", "quote", "sql_in"]

#: DuckDB's memory limit for the report's queries (``TRACESIM_REPORT_MEMORY`` overrides it).
DEFAULT_MEMORY_LIMIT = "256MB"
#: Rows per batch of a filtered read: the batch's strings are held as text only while it is
#: converted.
READ_BATCH_ROWS = 1 << 18
#: DuckDB's threads (``TRACESIM_REPORT_THREADS`` overrides; more threads may change the last
#: bits of float sums, never a verdict).
DEFAULT_THREADS = 1


def quote(name: str) -> str:
    """A column name as a SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def notna(column: str) -> str:
    """SQL: the float column holds a value (pandas' ``notna``: neither null nor NaN)."""
    c = quote(column)
    return f"({c} IS NOT NULL AND NOT isnan({c}))"


def sql_in(column: str, values: Iterable[Any]) -> str:
    """SQL: ``column IN (values)`` with the values as literals (strings quoted, numbers as
    ``repr``); never a user's text spliced unquoted."""
    lits = []
    for v in values:
        if isinstance(v, str):
            lits.append("'" + v.replace("'", "''") + "'")
        elif isinstance(v, bool):
            lits.append("TRUE" if v else "FALSE")
        elif isinstance(v, (int, float, np.integer, np.floating)):
            lits.append(repr(float(v)) if isinstance(v, (float, np.floating)) else str(int(v)))
        else:
            raise ValueError(f"{column}: cannot compare with {v!r}, expected strings or numbers")
    return f"{quote(column)} IN ({', '.join(lits)})" if lits else "FALSE"


@dataclass
class ResultsDataset:
    """Verified results files and their summary, read through DuckDB on demand.

    Attributes
    ----------
    files : list of Path
        The Parquet files holding the rows, in order (a dataset's parts, or one file).
    summary : dict or None
        The run's ``summary.json``.
    columns : tuple of str
        The table's columns.
    n_rows : int
    memory_limit : str
        DuckDB's ``memory_limit`` (e.g. ``"512MB"``); beyond it aggregation spills to disk.
    threads : int
    scheduler : str or None
        None: DuckDB answers :meth:`sums`; otherwise the Dask scheduler that does
        (``threads``, ``processes``, ``synchronous`` or a distributed scheduler's address;
        :mod:`tracesim.analysis.aggregate_dask`). Row reads are DuckDB's either way.
    """

    files: list[Path]
    summary: dict[str, Any] | None
    columns: tuple[str, ...]
    n_rows: int
    memory_limit: str = DEFAULT_MEMORY_LIMIT
    threads: int = DEFAULT_THREADS
    scheduler: str | None = None
    _con: Any = field(default=None, repr=False)
    _spill: Any = field(default=None, repr=False)
    _frame: pd.DataFrame | None = field(default=None, repr=False)

    @classmethod
    def from_frame(cls, frame: pd.DataFrame) -> ResultsDataset:
        """The same questions asked of an in-memory table (tests, small tables, callers that
        already hold the rows): DuckDB scans the DataFrame in place."""
        return cls(files=[], summary=None, columns=tuple(map(str, frame.columns)),
                   n_rows=len(frame), _frame=frame)

    @property
    def empty(self) -> bool:
        """True without rows (as ``DataFrame.empty``)."""
        return self.n_rows == 0

    def __contains__(self, column: object) -> bool:
        return column in self.columns

    def __len__(self) -> int:
        return self.n_rows

    def _connect(self):
        if self._con is None:
            import duckdb

            self._spill = tempfile.TemporaryDirectory(prefix="tracesim-report-")
            con = duckdb.connect(config={
                "memory_limit": self.memory_limit, "threads": int(self.threads),
                "temp_directory": self._spill.name, "preserve_insertion_order": True})
            # a long scan would otherwise draw DuckDB's progress bar into the command's output
            con.execute("SET enable_progress_bar = false")
            # ``__row``: the row's position in the table (file, then row in file), for the
            # consumers that take the first row of a group in the table's order.
            if self._frame is not None:
                con.register("results_frame", self._frame)
                con.execute("CREATE VIEW results AS SELECT *, row_number() OVER () - 1 AS "
                            "__row FROM results_frame")
            elif not self.files:
                raise ValueError("no results files to read")
            else:
                files = ", ".join("'" + str(f).replace("'", "''") + "'" for f in self.files)
                con.execute(
                    f"CREATE VIEW results AS SELECT * EXCLUDE (filename, file_row_number), "
                    f"(list_position([{files}], filename)::BIGINT << 40) + file_row_number "
                    f"AS __row FROM read_parquet([{files}], filename = true, "
                    "file_row_number = true)")
            self._con = con
        return self._con

    def close(self) -> None:
        """Close the DuckDB connection and remove its spill directory."""
        if self._con is not None:
            self._con.close()
            self._con = None
        if self._spill is not None:
            self._spill.cleanup()
            self._spill = None

    def query(self, sql: str) -> pd.DataFrame:
        """A SQL query over the view ``results`` as a DataFrame (a small result: sums per
        group, one row per configuration)."""
        return self._fetch(sql, None)

    def _fetch(self, sql: str, total: int | None) -> pd.DataFrame:
        """The result of ``sql``; with ``total`` (its row count) filled batch by batch into
        arrays of that length."""
        import pyarrow as pa

        reader = record_batches(self._connect(), sql, READ_BATCH_ROWS)
        if total is None:
            # batch by batch, each batch's text turned into shared str objects before the next
            # arrives: a result of many groups (one per sequence and configuration, ...) never
            # holds every row's text as Arrow does
            frames = [_frame(pa.Table.from_batches([b])) for b in reader]
            if not frames:
                return _frame(reader.schema.empty_table())
            return frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
        # Each column is one array of the result's length, filled batch by batch: no list of
        # pieces and no concatenation, so a read peaks at its result plus one batch.
        out: dict[str, np.ndarray] = {}
        at = 0
        for batch in reader:
            n = batch.num_rows
            for name, col in zip(batch.schema.names, batch.columns, strict=True):
                if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
                    # one str object per distinct value and batch: a row holds a reference,
                    # never its own copy of a long configuration id
                    values = _shared_strings(col)
                else:
                    values = col.to_pandas().to_numpy()
                have = out.get(name)
                if have is None:
                    have = out[name] = np.empty(total, dtype=values.dtype)
                elif have.dtype != values.dtype and not np.can_cast(values.dtype, have.dtype):
                    have = out[name] = have.astype(np.result_type(have.dtype, values.dtype)
                                                   if values.dtype != object else object)
                have[at:at + n] = values
            at += n
        if not out:
            return reader.schema.empty_table().to_pandas()
        # dtype object kept as it is: pandas would otherwise copy every row's text into its
        # string dtype (Arrow buffers), the memory this read avoids
        return pd.DataFrame({name: pd.Series(v, dtype=v.dtype, copy=False)
                             for name, v in out.items()}, copy=False)

    def read(self, columns: Sequence[str], where: str | None = None) -> pd.DataFrame:
        """The rows matching ``where`` (SQL over the results columns; None: all), only
        ``columns`` of them that the table has, in the table's order."""
        cols = [c for c in dict.fromkeys(columns) if c in self.columns]
        sql = f"SELECT {', '.join(map(quote, cols))} FROM results"
        if where:
            sql += f" WHERE {where}"
        total = int(self._connect().sql(f"SELECT count(*) FROM ({sql})").fetchall()[0][0])
        return self._fetch(sql, total)

    def sums(self, keys: Sequence[str], values: Sequence[str] = (), where: str | None = None,
             squares: bool = False) -> pd.DataFrame:
        """Per-group sufficient statistics: one row per distinct ``keys`` (rows whose key is
        null are left out, as pandas' ``groupby``), with ``rows``, and per value column
        ``n_<c>`` (non-missing values), ``sum_<c>`` and, with ``squares``, ``sumsq_<c>``.
        ``keys`` may be SQL expressions given as ``"expr AS name"``."""
        if self.scheduler is not None and self.files:
            from tracesim.analysis.aggregate_dask import dask_sums

            return dask_sums(self.files, self.columns, keys, values, where, squares,
                             self.scheduler)
        names = [k.rsplit(" AS ", 1)[-1].strip('"') for k in keys]
        exprs = [k if " AS " in k else quote(k) for k in keys]
        agg = ["COUNT(*) AS rows"]
        for c in values:
            v = f"CASE WHEN {notna(c)} THEN CAST({quote(c)} AS DOUBLE) END"
            agg += [f"COUNT({v}) AS {quote('n_' + c)}", f"SUM({v}) AS {quote('sum_' + c)}"]
            if squares:
                agg.append(f"SUM({v} * {v}) AS {quote('sumsq_' + c)}")
        inner = f"SELECT {', '.join(exprs + [quote(c) for c in values])} FROM results"
        if where:
            inner += f" WHERE {where}"
        keyed = ", ".join(map(quote, names))
        nonnull = " AND ".join(f"{quote(n)} IS NOT NULL" for n in names) or "TRUE"
        sql = (f"SELECT {keyed}{', ' if names else ''}{', '.join(agg)} FROM ({inner}) "
               f"WHERE {nonnull} " + (f"GROUP BY {keyed} ORDER BY {keyed}" if names else ""))
        return self.query(sql)

    def connection(self):
        """The DuckDB connection holding the view ``results`` (with ``__row``, the row's
        position in the table), for rules that take several statements: temporary tables of
        per-unit aggregates, window functions, batch-by-batch reads of sorted rows."""
        return self._connect()


def record_batches(con, sql: str, batch_rows: int):
    """The result of ``sql`` on DuckDB connection ``con`` as an Arrow record-batch reader of
    ``batch_rows`` rows a batch (``to_arrow_reader`` on DuckDB releases that have it,
    ``fetch_record_batch`` on earlier ones): a result streamed, never held whole."""
    rel = con.sql(sql)
    return (rel.to_arrow_reader(batch_rows) if hasattr(rel, "to_arrow_reader")
            else rel.fetch_record_batch(batch_rows))


def _shared_strings(col) -> np.ndarray:
    """An Arrow string array as an object array holding one ``str`` per distinct value (each
    row a reference to it); nulls are None."""
    import pyarrow.compute as pc

    encoded = pc.dictionary_encode(col)
    values = np.array([*encoded.dictionary.to_pylist(), None], dtype=object)
    codes = pc.fill_null(encoded.indices, len(values) - 1).to_numpy(zero_copy_only=False)
    return values[codes]


def _frame(table) -> pd.DataFrame:
    """A small Arrow result as a DataFrame, strings as Python objects."""
    import pyarrow as pa

    return pd.DataFrame({name: (pd.Series(_shared_strings(col.combine_chunks()), dtype=object)
                                if pa.types.is_string(col.type)
                                or pa.types.is_large_string(col.type) else col.to_pandas())
                         for name, col in zip(table.column_names, table.columns, strict=True)}
                        ) if table.num_columns else pd.DataFrame()


def _settings() -> tuple[str, int]:
    from tracesim.errors import UsageError

    memory = os.environ.get("TRACESIM_REPORT_MEMORY", DEFAULT_MEMORY_LIMIT)
    threads = os.environ.get("TRACESIM_REPORT_THREADS", str(DEFAULT_THREADS))
    if not threads.isdigit() or int(threads) < 1:
        raise UsageError(f"TRACESIM_REPORT_THREADS={threads!r}: expected a positive integer")
    if not memory[:-2].replace(".", "", 1).isdigit() or memory[-2:].upper() not in (
            "KB", "MB", "GB", "TB"):
        raise UsageError(f"TRACESIM_REPORT_MEMORY={memory!r}: expected a size such as 512MB "
                         "or 2GB")
    return memory, int(threads)


def open_results(directory: str | Path, *, trust_unsigned: bool = False,
                 notes: list[str] | None = None, memory_limit: str | None = None,
                 threads: int | None = None, scheduler: str | None = None) -> ResultsDataset:
    """The verified results of a sweep or replay output directory, unread.

    A results dataset (``manifest.json`` + parts) is verified part by part
    (:func:`tracesim.dataset_read.verify_dataset`: memory is one part's key columns); the
    single file of replay and earlier sweeps is verified as :func:`results_io.read_verified`
    does (which reads that file whole once: convert large ones to a dataset). Refusals are
    ``UsageError`` naming the file and the field, as :func:`results_io.load_results`.
    ``scheduler`` (a Dask scheduler; :class:`ResultsDataset`) is checked before any file is
    read: an unreachable address is a ``UsageError``.
    """
    import pyarrow.parquet as pq
    from tracesim.analysis.results_io import RESULT_FILES, _configs_path, _read_json, read_verified

    from tracesim.dataset import MANIFEST_FILE
    from tracesim.dataset_read import verify_dataset

    d = Path(directory)
    if scheduler is not None:
        from tracesim.analysis.aggregate_dask import check_scheduler_name

        check_scheduler_name(scheduler)
    mem, thr = _settings()
    mem, thr = memory_limit or mem, threads or thr
    for name in RESULT_FILES:
        path = d / name
        if not path.is_file():
            continue
        if path.name == MANIFEST_FILE:
            summary_path = path.parent / "summary.json"
            summary = _read_json(summary_path)
            files, found = verify_dataset(path.parent, summary, summary_path,
                                          configs=_configs_path(path),
                                          trust_unsigned=trust_unsigned)
        else:
            table, summary = read_verified(path, trust_unsigned=trust_unsigned,
                                           notes=(found := []), columns=["config_id"])
            del table
            files = [path]
        if notes is not None:
            notes.extend(found)
        n_rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
        columns = tuple(pq.read_schema(files[0]).names) if files else ()
        return ResultsDataset(files=list(files), summary=summary, columns=columns,
                              n_rows=n_rows, memory_limit=mem, threads=thr,
                              scheduler=scheduler)
    raise ValueError(f"{d}: no results file found (expected one of {list(RESULT_FILES)})")


def coverage_from_sums(sums: pd.DataFrame, value: str, stratum: str | None, cluster: str, *,
                       nominal: float, alpha: float, order: list[str] | None = None):
    """:func:`tracesim.analysis.coverage.cluster_coverage` from per-(stratum, cluster) sums.

    ``sums`` has one row per (stratum, cluster) with ``n_<value>`` and ``sum_<value>``
    (:meth:`ResultsDataset.sums`). The GEE (binomial, logit link, independence) that
    ``cluster_coverage`` fits with statsmodels has the closed form of
    :mod:`tracesim.analysis.cluster`: ``p = S / n``, logit-scale variance
    ``sum_c (S_c - p n_c)^2 / (n p (1 - p))^2``; strata with p in {0, 1} or one cluster get
    the exact Clopper–Pearson interval of ``int(S)`` in ``n``, as there.
    """
    from tracesim.analysis.coverage import CoverageResult

    n_col, s_col = f"n_{value}", f"sum_{value}"
    df = sums[sums[n_col] > 0]
    labels = (pd.Series("all", index=df.index) if stratum is None
              else df[stratum].astype(str))
    present = set(labels.tolist())
    names = [s for s in order if s in present] if order is not None else sorted(present)
    z = stats.norm.ppf(1 - alpha / 2)
    out: dict[str, list] = {k: [] for k in ("cov", "lo", "hi", "n", "g")}
    for name in names:
        g = df[labels == name].groupby(cluster, sort=False)[[n_col, s_col]].sum()
        n_c, s_c = g[n_col].to_numpy(float), g[s_col].to_numpy(float)
        n, s = n_c.sum(), s_c.sum()
        p = s / n
        if 0.0 < p < 1.0 and len(g) > 1:
            se = np.sqrt(((s_c - p * n_c) ** 2).sum()) / (n * p * (1 - p))
            b = np.log(p / (1 - p))
            lo, hi = 1 / (1 + np.exp(-(b - z * se))), 1 / (1 + np.exp(-(b + z * se)))
        else:
            k, m = int(s), int(n)
            lo = stats.beta.ppf(alpha / 2, k, m - k + 1) if k > 0 else 0.0
            hi = stats.beta.ppf(1 - alpha / 2, k + 1, m - k) if k < m else 1.0
        out["cov"].append(p)
        out["lo"].append(lo)
        out["hi"].append(hi)
        out["n"].append(int(n))
        out["g"].append(len(g))
    return CoverageResult(strata=[str(s) for s in names], coverage=np.array(out["cov"]),
                          ci_low=np.array(out["lo"]), ci_high=np.array(out["hi"]),
                          n_events=np.array(out["n"]), n_clusters=np.array(out["g"]),
                          nominal=nominal, alpha=alpha)
