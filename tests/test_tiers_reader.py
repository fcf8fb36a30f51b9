"""``tracesim report --tiers``' reader: the per-sequence curves aggregated by DuckDB from
tiers.parquet equal :func:`scheduler_curves` of the whole table (first rows of each (layer,
KV head, step) and (layer, step) as ``drop_duplicates`` keeps them, missing values skipped as
pandas' sums, rows with a missing key left out), and the report's tables read the same."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from tracesim.analysis.tiers import (
    curves_tables,
    read_scheduler_curves,
    scheduler_curves,
    tiers_tables,
)


def _tiers_rows(n: int = 4000, seed: int = 3) -> pd.DataFrame:
    """Rows shaped as tiers.parquet's, shuffled, with per-row evicted bytes and stall that
    differ within a (layer, KV head, step) so the first row's value matters, and gaps."""
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({
        "sequence_id": rng.choice(["s0", "s1", "s10", "s2"], n),
        "config_id": rng.choice(["snapkv|topk:0.25", "h2o|poisson:0.25"], n),
        "scheduler": rng.choice(["random", "confidence", "certificate", "oracle"], n),
        "fetch_budget": rng.choice([0.0, 0.1, 0.5], n),
        "layer": rng.integers(0, 3, n), "kv_head": rng.integers(0, 2, n),
        "head": rng.integers(0, 4, n), "step": rng.integers(0, 5, n),
        "err2_before": rng.gamma(2.0, 1.0, n), "bytes_moved": rng.integers(0, 4096, n) * 1.0,
        "evicted_bytes": rng.integers(1, 9, n) * 512.0, "stall_ms": rng.gamma(1.0, 0.1, n),
        "fetch_ms": rng.gamma(1.0, 0.05, n)})
    df["err2_after"] = df["err2_before"] * rng.uniform(0, 1, n)
    gaps = rng.uniform(size=n) < 0.03
    df.loc[gaps, "err2_after"] = np.nan
    df.loc[rng.uniform(size=n) < 0.02, "stall_ms"] = np.nan
    df.loc[rng.uniform(size=n) < 0.01, "fetch_budget"] = np.nan
    df.loc[rng.uniform(size=n) < 0.01, "sequence_id"] = None
    return df


def test_curves_from_duckdb_equal_the_whole_table(tmp_path):
    df = _tiers_rows()
    path = tmp_path / "tiers.parquet"
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), path, row_group_size=512)
    whole = scheduler_curves(pq.read_table(path).to_pandas())
    read = read_scheduler_curves(path, memory_limit="64MB")
    assert list(read.columns) == list(whole.columns) and len(read) == len(whole) > 50
    for c in whole.columns:
        if pd.api.types.is_float_dtype(whole[c]):
            assert np.allclose(read[c].to_numpy(float), whole[c].to_numpy(float), rtol=1e-12,
                               atol=0, equal_nan=True), c
        else:
            assert read[c].astype(str).tolist() == whole[c].astype(str).tolist(), c
    # the first row of each (layer, KV head, step) is the one counted: another order differs
    flipped = df.iloc[::-1]
    pq.write_table(pa.Table.from_pandas(flipped, preserve_index=False), tmp_path / "f.parquet")
    assert not np.allclose(read_scheduler_curves(tmp_path / "f.parquet")["evicted_bytes"],
                           read["evicted_bytes"])
    assert curves_tables(read) == tiers_tables(pq.read_table(path).to_pandas())
