"""``tracesim export``: CSV and hive-partitioned Parquet datasets of results tables."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from tracesim.app.cli import main as cli_main
from tracesim.export import ExportError, export_results


def _results(n_per: int = 7) -> pa.Table:
    """A small results-like table: three configurations and the full cache (budget NaN)."""
    configs = [("snapkv", "poisson", 0.25), ("snapkv", "topk", 0.25), ("h2o", "poisson", 0.5),
               ("full", "none", math.nan)]
    rows = {"sequence_id": [], "score": [], "design": [], "budget": [], "err2": [],
            "cert2": []}
    rng = np.random.default_rng(0)
    for s, d, b in configs:
        for i in range(n_per):
            rows["sequence_id"].append(f"seq{i % 3}")
            rows["score"].append(s)
            rows["design"].append(d)
            rows["budget"].append(b)
            rows["err2"].append(float(rng.random()))
            rows["cert2"].append(None if d != "poisson" else float(rng.random()))
    return pa.table(rows, schema=pa.schema([
        ("sequence_id", pa.string()), ("score", pa.string()), ("design", pa.string()),
        ("budget", pa.float64()), ("err2", pa.float64()), ("cert2", pa.float64())]))


@pytest.fixture()
def results_dir(tmp_path):
    d = tmp_path / "sweep" / "results"
    d.mkdir(parents=True)
    pq.write_table(_results(), d / "results.parquet", row_group_size=5)
    return tmp_path / "sweep"


def test_parquet_dataset_is_hive_partitioned_and_complete(results_dir, tmp_path):
    out, rows = export_results(results_dir, tmp_path / "ds", "parquet-dataset",
                               batch_rows=3, max_rows_per_file=4)
    src = _results()
    assert rows == src.num_rows
    assert (out / "score=snapkv" / "design=poisson" / "budget=0.25").is_dir()
    assert (out / "score=full" / "design=none" / "budget=__HIVE_DEFAULT_PARTITION__").is_dir()
    dataset = ds.dataset(out, format="parquet", partitioning=ds.partitioning(
        pa.schema([("score", pa.string()), ("design", pa.string()), ("budget", pa.float64())]),
        flavor="hive"))
    table = dataset.to_table()
    assert table.num_rows == src.num_rows
    keys = ["score", "design", "sequence_id", "err2"]
    got = table.select(src.column_names).sort_by([(k, "ascending") for k in keys])
    want = src.sort_by([(k, "ascending") for k in keys])
    assert got.column("err2").equals(want.column("err2"))
    assert got.column("cert2").null_count == want.column("cert2").null_count
    # The full cache's NaN budget became a null partition value; the others are exact.
    full = got.filter(pc.equal(got["score"], "full"))
    assert full["budget"].null_count == full.num_rows
    rest = got.filter(pc.not_equal(got["score"], "full"))
    assert rest["budget"].equals(want.filter(pc.not_equal(want["score"], "full"))["budget"])
    # Partition pruning: a filter on the partition keys reads only that directory.
    sub = dataset.to_table(filter=(ds.field("score") == "snapkv") & (ds.field("budget") == 0.25)
                           & (ds.field("design") == "poisson"))
    assert sub.num_rows == 7
    # max_rows_per_file splits a partition into several files.
    assert len(list((out / "score=snapkv" / "design=poisson" / "budget=0.25").glob("*"))) == 2


def test_csv_nulls_are_empty_and_roundtrip(results_dir, tmp_path):
    out, rows = export_results(results_dir / "results" / "results.parquet", tmp_path / "csv",
                               "csv")
    text = (out / "results.csv").read_text()
    header, first = text.splitlines()[:2]
    assert header.split(",")[:4] == ['"sequence_id"', '"score"', '"design"', '"budget"']
    topk_line = next(line for line in text.splitlines() if '"topk"' in line)
    assert topk_line.endswith(",")  # cert2 is null: an empty last field
    back = pacsv.read_csv(out / "results.csv")
    assert back.num_rows == rows == _results().num_rows
    assert back["cert2"].null_count == _results()["cert2"].null_count


def test_export_errors_exit_2_and_leave_nothing(tmp_path, capsys):
    assert cli_main(["export", str(tmp_path / "nope"), "--format", "csv",
                     "--out", str(tmp_path / "o")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_main(["export", str(empty), "--format", "csv", "--out",
                     str(tmp_path / "o")]) == 2
    assert "no results file found" in capsys.readouterr().err
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet")
    assert cli_main(["export", str(bad), "--format", "parquet-dataset", "--out",
                     str(tmp_path / "o")]) == 2
    assert "not a readable Parquet file" in capsys.readouterr().err
    no_part = tmp_path / "nopart.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), no_part)
    assert cli_main(["export", str(no_part), "--format", "parquet-dataset", "--out",
                     str(tmp_path / "o")]) == 2
    assert "missing" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".o.")]  # no temp left
    with pytest.raises(ExportError, match="expected one of"):
        export_results(no_part, tmp_path / "o", "xlsx")


def test_existing_output_refused_unless_overwrite(results_dir, tmp_path, capsys):
    out = tmp_path / "o"
    assert cli_main(["export", str(results_dir), "--format", "csv", "--out", str(out)]) == 0
    assert "28 rows" in capsys.readouterr().out
    assert cli_main(["export", str(results_dir), "--format", "csv", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli_main(["export", str(results_dir), "--format", "parquet-dataset", "--out",
                     str(out), "--overwrite"]) == 0
    assert (out / "score=h2o").is_dir() and not (out / "results.csv").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o", "sweep"]
