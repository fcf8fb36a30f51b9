"""The calibration figures' numbers from the results dataset, without holding its rows.

The certificate-against-error and coverage-against-level figures
(:mod:`tracesim.analysis.report_figures`) draw, per certified design, a histogram of (C, |e|),
the median C and |e| per certificate decile, the median |e| / C and the share of rows within
each nominal level. :func:`calibration_stats_of` computes the same
:class:`~tracesim.analysis.report_figures.CalibrationStats` as
:func:`~tracesim.analysis.report_figures.calibration_stats` of the rows in memory:

* counts (histogram cells, rows within each level) add up over batches of rows, so they are
  summed over one unsorted pass, a batch at a time;
* quantiles and medians are order statistics: DuckDB sorts the design's rows (out of core,
  under its memory limit) and the pass keeps only the values at the positions numpy's
  ``quantile`` and ``median`` read (:func:`quantile_positions`), interpolated as numpy does
  (:func:`lerp`). Extreme positions (the axis limits at 0.1% and 99.9%) use ``ORDER BY ...
  LIMIT``, which keeps only that many values.

Memory is a batch of rows and a few small arrays, whatever the rows; the price is four sorts
of each design's certified rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from tracesim.analysis.aggregate import READ_BATCH_ROWS, record_batches, sql_in
from tracesim.analysis.report_figures import (
    AXIS_QUANTILES,
    DECILES,
    N_EDGES,
    CalibrationStats,
    DesignCalibration,
    axis_limits,
    calibration_counts,
    decile_bins,
    histogram,
)

__all__ = ["calibration_stats_of", "lerp", "quantile_positions", "sqrt_threshold"]

#: Largest ``LIMIT`` an order statistic is read with (DuckDB keeps that many values); deeper
#: positions stream the whole sort, which spills to disk.
TOP_LIMIT = 1 << 16
_C2 = "CAST(\"cert2\" AS DOUBLE)"
_E2 = "CAST(\"err2\" AS DOUBLE)"


def quantile_positions(n: int, q: Sequence[float] | np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy's default (``linear``) quantile ``q`` of ``n`` sorted values: the positions of
    the two values it interpolates between, and the weight ``gamma`` of the second, computed
    as ``numpy.quantile`` computes them."""
    virtual = np.asanyarray((n - 1) * np.asarray(q, dtype=np.float64))
    prev = np.floor(virtual)
    nxt = prev + 1
    above = virtual >= n - 1
    prev[above] = -1
    nxt[above] = -1
    below = virtual < 0
    prev[below] = 0
    nxt[below] = 0
    gamma = np.asanyarray(virtual - prev, dtype=virtual.dtype)
    prev_i, next_i = prev.astype(np.intp), nxt.astype(np.intp)
    return np.where(prev_i < 0, n + prev_i, prev_i), np.where(next_i < 0, n + next_i, next_i), gamma


def lerp(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> np.ndarray:
    """numpy's interpolation between the two values of a quantile (``numpy.quantile``)."""
    diff = b - a
    out = np.add(a, diff * t)
    np.subtract(b, diff * (1 - t), out=out, where=t >= 0.5)
    return out


def sqrt_threshold(q: float) -> float:
    """The smallest double ``x`` with ``numpy.sqrt(x) >= q``: ``sqrt(cert2) >= q`` is then
    ``cert2 >= x`` in SQL, exactly, whatever DuckDB's square root rounds to."""
    with np.errstate(over="ignore"):  # q = inf: its threshold is inf
        x = np.float64(q) * np.float64(q)
        while x > 0 and np.sqrt(x) >= q:
            x = np.nextafter(x, -np.inf)
        while np.sqrt(x) < q:
            x = np.nextafter(x, np.inf)
    return float(x)


def _double(v: float) -> str:
    return f"CAST('{float(v)!r}' AS DOUBLE)"


def _rows_at(con, sql: str, positions: Iterable[int], batch_rows: int
             ) -> dict[int, tuple[float, ...]]:
    """The rows of ``sql`` (an ``ORDER BY`` query) at ``positions`` (0-based), streamed
    batch by batch; only the wanted rows are kept."""
    want = sorted(set(int(p) for p in positions))
    out: dict[int, tuple[float, ...]] = {}
    if not want:
        return out
    at, i = 0, 0
    for batch in record_batches(con, sql, batch_rows):
        n = batch.num_rows
        while i < len(want) and want[i] < at + n:
            k = want[i] - at
            out[want[i]] = tuple(batch.column(j)[k].as_py() for j in range(batch.num_columns))
            i += 1
        at += n
        if i == len(want):
            break
    if i < len(want):
        raise RuntimeError(f"position {want[i]} beyond the {at} rows of a sorted read")
    return out


def _order_stats(con, select: str, key: str, n: int, positions: Iterable[int],
                 batch_rows: int) -> dict[int, tuple[float, ...]]:
    """Rows at ``positions`` of ``select`` sorted by ``key`` (``n`` rows in all): positions
    near either end from ``ORDER BY ... LIMIT`` (ascending, or descending counted from the
    end), the others from the whole sort streamed."""
    pos = sorted(set(int(p) for p in positions))
    low = [p for p in pos if p < TOP_LIMIT]
    high = [p for p in pos if p >= TOP_LIMIT and n - p <= TOP_LIMIT]
    mid = [p for p in pos if p >= TOP_LIMIT and n - p > TOP_LIMIT]
    out: dict[int, tuple[float, ...]] = {}
    if low:
        out |= _rows_at(con, f"{select} ORDER BY {key} LIMIT {low[-1] + 1}", low, batch_rows)
    if high:
        desc = ", ".join(f"{k.strip()} DESC" for k in key.split(","))
        got = _rows_at(con, f"{select} ORDER BY {desc} LIMIT {n - high[0]}",
                       [n - 1 - p for p in high], batch_rows)
        out |= {n - 1 - p: v for p, v in got.items()}
    if mid:
        out |= _rows_at(con, f"{select} ORDER BY {key}", mid, batch_rows)
    return out


def _quantiles(values: dict[int, float], n: int, q: np.ndarray) -> np.ndarray:
    prev, nxt, gamma = quantile_positions(n, q)
    a = np.array([values[int(p)] for p in prev], dtype=np.float64)
    b = np.array([values[int(p)] for p in nxt], dtype=np.float64)
    return lerp(a, b, gamma)


def _median(values: dict[int, float], start: int, n: int) -> float:
    """``numpy.median`` of the ``n`` sorted values from ``start`` (their mean of the middle
    one or two)."""
    mid = [start + (n - 1) // 2] if n % 2 else [start + n // 2 - 1, start + n // 2]
    return float(np.mean(np.array([values[p] for p in mid], dtype=np.float64)))


def _median_positions(counts: np.ndarray) -> list[int]:
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return [int(s + k) for s, m in zip(starts, counts, strict=True) if m
            for k in ({(m - 1) // 2} if m % 2 else {m // 2 - 1, m // 2})]


def _axis_limits(con, where: str, designs: list[str], batch_rows: int) -> tuple[float, float]:
    """:func:`report_figures.axis_limits` of every design's positive certificates and errors
    (sorted by their squares: the square root keeps the order)."""
    rows = f"FROM results WHERE {where} AND {sql_in('design', designs)}"
    values = (f"SELECT {_C2} AS v {rows} AND {_C2} > 0 UNION ALL "
              f"SELECT {_E2} AS v {rows} AND {_E2} > 0")
    n = int(con.sql(f"SELECT count(*) FROM ({values})").fetchall()[0][0])
    if n == 0:
        return axis_limits(None)
    prev, nxt, _ = quantile_positions(n, AXIS_QUANTILES)
    got = _order_stats(con, f"SELECT v FROM ({values})", "v", n, [*prev, *nxt], batch_rows)
    roots = {p: float(np.sqrt(np.float64(v[0]))) for p, v in got.items()}
    return axis_limits(_quantiles(roots, n, AXIS_QUANTILES))


def _design(con, where: str, n: int, sequences: int, lo: float, hi: float,
            batch_rows: int) -> DesignCalibration:
    """One design's :class:`DesignCalibration` (``where``: its certified rows, ``n`` of
    them)."""
    select = f"SELECT {_C2} AS c2, {_E2} AS e2 FROM results WHERE {where}"
    prev, nxt, _ = quantile_positions(n, DECILES)
    got = _order_stats(con, select, "c2", n, [*prev, *nxt], batch_rows)
    roots = {p: float(np.sqrt(np.float64(v[0]))) for p, v in got.items()}
    q = np.unique(_quantiles(roots, n, DECILES))
    # counts: one unsorted pass, a batch at a time
    hist = np.zeros((N_EDGES - 1, N_EDGES - 1))
    covered, defined, nan_ratio = None, 0, 0
    bins = np.zeros(max(len(q) - 1, 0), dtype=np.int64)
    nan_e = np.zeros_like(bins)  # a NaN error makes its decile's median NaN, as in numpy
    for batch in record_batches(con, select, batch_rows):
        c2 = batch.column(0).to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
        e2 = batch.column(1).to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
        hist += histogram(c2, e2, lo, hi)
        cov, d = calibration_counts(c2, e2)
        covered = cov if covered is None else covered + cov
        defined += d
        with np.errstate(invalid="ignore"):
            c, e = np.sqrt(c2), np.sqrt(e2)
            nan_ratio += int(np.isnan(e / c).sum())
        if len(q) > 1:
            idx = decile_bins(c, q)
            bins += np.bincount(idx, minlength=len(q) - 1)
            nan_e += np.bincount(idx[np.isnan(e)], minlength=len(q) - 1)
    medians: tuple[tuple[float, float], ...] = ()
    if len(q) > 1:
        # the decile of a row, in SQL: sqrt(cert2) >= q_k is cert2 >= sqrt_threshold(q_k)
        reached = " + ".join(f"CAST({_C2} >= {_double(sqrt_threshold(v))} AS INTEGER)"
                             for v in q)
        binned = (f"SELECT LEAST(GREATEST({reached} - 1, 0), {len(q) - 2}) AS b, {_C2} AS c2, "
                  f"{_E2} AS e2 FROM results WHERE {where}")
        check = con.sql(f"SELECT b, count(*) FROM ({binned}) GROUP BY b ORDER BY b").fetchall()
        sql_bins = np.zeros_like(bins)
        for b, m in check:
            sql_bins[int(b)] = m
        if not np.array_equal(sql_bins, bins):
            raise RuntimeError(f"certificate deciles differ between SQL {sql_bins.tolist()} and "
                               f"numpy {bins.tolist()}")
        at = _median_positions(bins)
        c_at = _order_stats(con, f"SELECT c2 FROM ({binned})", "b, c2", n, at, batch_rows)
        e_at = _order_stats(con, f"SELECT e2 FROM ({binned})", "b, e2", n, at, batch_rows)
        starts = np.concatenate([[0], np.cumsum(bins)[:-1]])
        c_root = {p: float(np.sqrt(np.float64(v[0]))) for p, v in c_at.items()}
        e_root = {p: float(np.sqrt(np.float64(v[0]))) for p, v in e_at.items()}
        medians = tuple((_median(c_root, int(s), int(m)),
                         float("nan") if bad else _median(e_root, int(s), int(m)))
                        for s, m, bad in zip(starts, bins, nan_e, strict=True) if m)
    ratio = float("nan")
    if not nan_ratio:  # numpy's median of values holding a NaN is NaN
        got = _order_stats(con, f"SELECT c2, e2, sqrt(e2) / sqrt(c2) AS r FROM ({select})",
                           "r", n, _median_positions(np.array([n])), batch_rows)
        ratio = _median({p: float(np.sqrt(np.float64(v[1])) / np.sqrt(np.float64(v[0])))
                         for p, v in got.items()}, 0, n)
    return DesignCalibration(n, sequences, hist, medians, ratio,
                             covered if covered is not None else np.zeros(0, np.int64), defined)


def calibration_stats_of(ds, where: str, batch_rows: int = READ_BATCH_ROWS
                         ) -> CalibrationStats:
    """:func:`report_figures.calibration_stats` of the rows of ``ds`` (a
    :class:`~tracesim.analysis.aggregate.ResultsDataset`) matching ``where`` (certified, a
    positive certificate and an error), one design at a time, never holding its rows."""
    con = ds.connection()
    per = con.sql(f"SELECT design, count(*) AS n, COUNT(DISTINCT sequence_id) AS s FROM "
                  f"results WHERE {where} AND design IS NOT NULL GROUP BY design "
                  "ORDER BY design").fetchall()
    per = [(str(d), int(n), int(s)) for d, n, s in per if n]
    lo, hi = _axis_limits(con, where, [d for d, _, _ in per], batch_rows)
    designs = {d: _design(con, f"{where} AND {sql_in('design', [d])}", n, s, lo, hi, batch_rows)
               for d, n, s in per}
    return CalibrationStats(float(lo), float(hi), designs)
