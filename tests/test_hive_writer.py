"""tracesim.hive_writer: the same hive dataset as pyarrow's write_dataset, with bounded buffers."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from tracesim.hive_writer import write_hive

KEYS = ("score", "design", "budget")


def _table(n: int = 2000, seed: int = 3) -> pa.Table:
    rng = np.random.default_rng(seed)
    scores = np.array(["snapkv", "h2o", "a b/c", "full"])[rng.integers(0, 4, n)]
    designs = np.array(["topk", "poisson"])[rng.integers(0, 2, n)]
    budgets = np.array([0.1, 0.25, 1.0])[rng.integers(0, 3, n)]
    budget = pa.array(budgets, mask=scores == "full")  # the full cache's budget is null
    return pa.table({"row": np.arange(n), "score": scores, "design": designs, "budget": budget,
                     "err2": rng.random(n)})


def _files_by_directory(root) -> dict[str, pa.Table]:
    out = {}
    for f in sorted(root.rglob("*.parquet")):
        rel = str(f.parent.relative_to(root))
        t = pq.read_table(f)
        out[rel] = pa.concat_tables([out[rel], t]) if rel in out else t
    return out


@pytest.mark.parametrize("buffered_rows", [7, 1 << 18])
def test_same_directories_and_rows_as_write_dataset(tmp_path, buffered_rows):
    table = _table()
    batches = table.to_batches(max_chunksize=97)
    ours = tmp_path / "ours"
    ours.mkdir()
    rows = write_hive(batches, table.schema, ours, KEYS, max_rows_per_file=10_000,
                      row_group_rows=50, buffered_rows=buffered_rows)
    assert rows == table.num_rows
    ref = tmp_path / "ref"
    part_schema = pa.schema([table.schema.field(c) for c in KEYS])
    ds.write_dataset(table, ref, format="parquet", use_threads=False, preserve_order=True,
                     partitioning=ds.partitioning(part_schema, flavor="hive"),
                     basename_template="part-{i}.parquet")
    got, want = _files_by_directory(ours), _files_by_directory(ref)
    assert sorted(got) == sorted(want)  # Arrow's escaping ("a%20b%2Fc") and null directory
    assert any("__HIVE_DEFAULT_PARTITION__" in d for d in got)
    for d, t in got.items():
        assert t.column_names == ["row", "err2"]  # partition columns live in the path only
        # every partition's rows in the input's order
        assert t.equals(want[d].select(t.column_names)), d
    back = ds.dataset(ours, format="parquet", partitioning=ds.partitioning(
        part_schema, flavor="hive")).to_table().sort_by("row")
    assert back.select(table.column_names).equals(table)


def test_buffers_stay_bounded(tmp_path, monkeypatch):
    # 24 partitions of ~500 rows: without the bound, each would be written whole at the end
    table = _table(12_000)
    held = []

    class Recording(pq.ParquetWriter):
        def write_table(self, table, row_group_size=None):
            held.append(table.num_rows)
            super().write_table(table, row_group_size=row_group_size)

    monkeypatch.setattr(pq, "ParquetWriter", Recording)
    rows = write_hive(table.to_batches(max_chunksize=100), table.schema, tmp_path, KEYS,
                      max_rows_per_file=10**6, row_group_rows=10**6, buffered_rows=64)
    assert rows == 12_000 and sum(held) == 12_000
    # a flush writes one partition's buffer: never more than the bound plus one input batch
    assert max(held) <= 64 + 100
    assert len(held) > 24


def test_files_split_at_max_rows(tmp_path):
    table = _table(3000)
    write_hive(table.to_batches(max_chunksize=100), table.schema, tmp_path, KEYS,
               max_rows_per_file=40, row_group_rows=16, buffered_rows=64)
    for directory in {f.parent for f in tmp_path.rglob("*.parquet")}:
        files = sorted(directory.glob("part-*.parquet"), key=lambda p: int(p.stem[5:]))
        sizes = [pq.ParquetFile(f).metadata.num_rows for f in files]
        assert all(s == 40 for s in sizes[:-1]) and 0 < sizes[-1] <= 40
        for f in files:
            meta = pq.ParquetFile(f).metadata
            assert all(meta.row_group(i).num_rows <= 16 for i in range(meta.num_row_groups))
    assert sum(pq.ParquetFile(f).metadata.num_rows for f in tmp_path.rglob("*.parquet")) == 3000
