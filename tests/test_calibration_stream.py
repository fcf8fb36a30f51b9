"""The calibration figures' numbers from the dataset (counts over batches, order statistics
from DuckDB sorts) equal numpy's on the rows in memory, and so do the figures."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tracesim.analysis import calibration_stream as cs
from tracesim.analysis import report_figures as rfig
from tracesim.analysis.aggregate import ResultsDataset
from tracesim.analysis.report_parts import _figure_where


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 11, 101, 1000])
def test_quantiles_from_positions_are_numpys(n):
    rng = np.random.default_rng(n)
    x = np.sort(rng.choice(rng.lognormal(size=max(2, n // 3)), n))  # ties
    for q in (rfig.DECILES, rfig.AXIS_QUANTILES, np.array([0.5, 0.25, 1.0, 0.0])):
        prev, nxt, gamma = cs.quantile_positions(n, q)
        got = cs.lerp(x[prev], x[nxt], gamma)
        assert np.array_equal(got, np.quantile(x, q)), q


def test_sqrt_threshold_is_the_smallest_square():
    rng = np.random.default_rng(0)
    for q in [*rng.lognormal(0, 30, 2000), 1e-300, 5e-324, 1.0, 2.0, np.inf]:
        x = cs.sqrt_threshold(q)
        assert np.sqrt(x) >= q and np.sqrt(np.nextafter(x, -np.inf)) < q, q


def _rows(n: int = 30_000, seed: int = 3) -> pd.DataFrame:
    """Rows of three designs over 23 sequences: certificates with ties and zeros, missing
    certificates and errors, zero and tied errors, uncertified rows."""
    rng = np.random.default_rng(seed)
    cert2 = np.round(rng.lognormal(-4, 2, n), 3)  # many ties, some zero
    cert2[rng.random(n) < 0.02] = np.nan
    err2 = cert2 * rng.chisquare(3, n) / 3
    err2[rng.random(n) < 0.05] = 0.0
    err2[rng.random(n) < 0.02] = np.nan
    err2[rng.random(n) < 0.05] = 0.125  # tied errors
    return pd.DataFrame({
        "sequence_id": rng.choice([f"s{i:02d}" for i in range(23)], n),
        "design": rng.choice(["poisson", "bernoulli", "topk"], n, p=[0.6, 0.3, 0.1]),
        "certified": rng.random(n) < 0.85, "cert2": cert2, "err2": err2})


def _assert_same(got: rfig.CalibrationStats, want: rfig.CalibrationStats) -> None:
    assert (got.lo, got.hi) == (want.lo, want.hi)
    assert sorted(got.designs) == sorted(want.designs)
    for d, w in want.designs.items():
        g = got.designs[d]
        assert (g.rows, g.sequences, g.defined) == (w.rows, w.sequences, w.defined), d
        assert np.array_equal(g.hist, w.hist) and np.array_equal(g.covered, w.covered), d
        assert g.medians == w.medians and g.ratio == w.ratio, d


@pytest.mark.parametrize("top_limit", [cs.TOP_LIMIT, 5, 100])
def test_calibration_stats_of_the_dataset_equal_the_rows(tmp_path, monkeypatch, top_limit):
    """Two parts read in batches of 997 rows. Every order statistic comes from ``ORDER BY ...
    LIMIT`` (the default, on these few rows), from whole sorts streamed (``LIMIT`` at most
    5), or both (at most 100: the axis limits from ``LIMIT`` ascending and descending, the
    deciles and medians from whole sorts)."""
    monkeypatch.setattr(cs, "TOP_LIMIT", top_limit)
    df = _rows()
    files = [tmp_path / "a.parquet", tmp_path / "b.parquet"]
    half = len(df) // 2
    pq.write_table(pa.Table.from_pandas(df.iloc[:half], preserve_index=False), files[0])
    pq.write_table(pa.Table.from_pandas(df.iloc[half:], preserve_index=False), files[1])
    ds = ResultsDataset(files=files, summary=None, columns=tuple(df.columns), n_rows=len(df))
    got = cs.calibration_stats_of(ds, _figure_where(), batch_rows=997)
    want = rfig.calibration_stats(df)
    assert len(want.designs) == 3 and all(len(d.medians) > 5 for d in want.designs.values())
    _assert_same(got, want)
    assert rfig.certificate_error_figure(got) == rfig.certificate_error_figure(df)
    assert rfig.coverage_level_figure(got, 64) == rfig.coverage_level_figure(df, 64)


def test_one_value_per_design_and_no_rows():
    """A design whose certificates are all equal has one decile (no medians drawn), and
    no certified row draws no figure."""
    df = pd.DataFrame({"sequence_id": ["a", "b", "c", "d"], "design": "poisson",
                       "certified": True, "cert2": 0.5, "err2": [0.1, 0.2, 0.0, 0.4]})
    ds = ResultsDataset.from_frame(df)
    _assert_same(cs.calibration_stats_of(ds, _figure_where()), rfig.calibration_stats(df))
    none = cs.calibration_stats_of(ds, f"{_figure_where()} AND FALSE")
    assert not none.designs and rfig.certificate_error_figure(none) is None
    assert rfig.coverage_level_figure(none) is None
