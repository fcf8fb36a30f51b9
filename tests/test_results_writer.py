"""``tracesim replay`` and ``tracesim peers`` write the sweep's results dataset (parts +
manifest) through the one writer: the same rows on 1 and 2 threads, parts written as work
finishes and resumed after a failure, disk full mid-part losing nothing, a part of another run
refused naming ``run_id``, and the parts read directly by Dask, DuckDB and pandas."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.replay_fixtures import build_store
from tracesim.app.cli import main as cli_main
from tracesim.dataset import BUILD_DIR
from tracesim.dataset_read import read_results
from tracesim.digests import sha256_file
from tracesim.errors import UsageError

ARGS = ["--score", "snapkv", "--design", "topk,poisson", "--budget", "0.4", "--seeds", "2",
        "--window", "8", "--no-progress"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("writer")
    store = build_store(root / "store", n_seqs=3, n_layers=2, n_heads=2, n_kv=1, d=8)
    for name, extra in (("one", ["--threads", "1"]), ("two", ["--threads", "2"]),
                        ("other", ["--seeds", "3"])):
        assert cli_main(["replay", str(store), *ARGS, *extra, "--out", str(root / name)]) == 0
    return root, store


def _snapshot(out: Path, rows_only: bool = False) -> dict[str, bytes]:
    """The results files by name; ``rows_only``: the parts and the manifest (the summary
    records the wall time)."""
    return {str(p.relative_to(out)): p.read_bytes()
            for p in sorted((out / "results").rglob("*"))
            if p.is_file() and not (rows_only and p.name == "summary.json")}


def _resign(out: Path) -> None:
    """Re-record every part's sha256 and rows, the manifest's rows and the summary's sha256 of
    the manifest, as someone who knows the layout would after swapping files."""
    res = out / "results"
    man = json.loads((res / "manifest.json").read_text())
    for part in man["parts"]:
        part["sha256"] = sha256_file(res / part["file"])
        part["rows"] = pq.read_metadata(res / part["file"]).num_rows
    man["n_rows"] = sum(p["rows"] for p in man["parts"])
    (res / "manifest.json").write_text(json.dumps(man))
    summary = json.loads((res / "summary.json").read_text())
    summary.update(results_sha256=sha256_file(res / "manifest.json"), n_rows=man["n_rows"])
    (res / "summary.json").write_text(json.dumps(summary))


def test_layout_and_same_rows_on_one_and_two_threads(runs):
    from tracesim.policies import policy_grid
    from tracesim.replay import replay
    from tracesim.store import open_store

    root, store = runs
    res = root / "one" / "results"
    man = json.loads((res / "manifest.json").read_text())
    assert man["format"] == "tracesim-results-dataset" and len(man["run_id"]) == 64
    assert [p["file"] for p in man["parts"]] == [f"parts/part-0000{i}.parquet" for i in range(3)]
    assert [p["sequence_id"] for p in man["parts"]] == ["seq0", "seq1", "seq2"]
    for part in man["parts"]:  # each part's record is in its own key-value metadata
        meta = json.loads(pq.read_metadata(res / part["file"]).metadata[b"tracesim.sweep.task"])
        assert meta["run_id"] == man["run_id"] and meta["key"] == part["key"]
        assert meta["rows"] == part["rows"] and part["sha256"] == sha256_file(res / part["file"])
    summary = json.loads((res / "summary.json").read_text())
    assert summary["results_file"] == "manifest.json"
    assert summary["results_sha256"] == sha256_file(res / "manifest.json")
    assert not (root / "one" / BUILD_DIR).exists() and not (root / "one" / "replay.parquet")\
        .exists()
    one, two = read_results(root / "one"), read_results(root / "two")
    assert one.equals(two)  # numba threads change nothing, bit for bit
    assert _snapshot(root / "one", True) == _snapshot(root / "two", True)
    pols = policy_grid(["snapkv"], ["topk", "poisson"], [0.4],
                       score_params={"snapkv": {"window": 8}})
    api = replay(open_store(store), pols, seeds=2, progress=False)
    assert one.equals(api.replace_schema_metadata(None))  # the rows of one in-memory replay


def test_disk_full_mid_part_loses_nothing_and_the_rerun_resumes(runs, tmp_path, monkeypatch,
                                                               capsys):
    root, store = runs
    out = tmp_path / "out"
    shutil.copytree(root / "other", out)  # earlier results of another run
    before = _snapshot(out)
    writes = {"n": 0}
    real = pq.ParquetWriter.write_batch

    def write_batch(self, batch, *args, **kwargs):
        writes["n"] += 1
        # One batch per part here (a sequence's layers share one batch up to BATCH_ROWS
        # rows): part 0 done, part 1's batch fails.
        if writes["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, batch, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetWriter, "write_batch", write_batch)
    code = cli_main(["replay", str(store), *ARGS, "--out", str(out)])
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert code == 2 and "disk full" in err and "Traceback" not in err, err
    assert _snapshot(out) == before  # the earlier results, byte for byte
    built = sorted(p.name for p in (out / BUILD_DIR / "parts").iterdir())
    assert built == ["part-00000.parquet"]  # the finished part kept, no partial part
    assert cli_main(["replay", str(store), *ARGS, "--out", str(out)]) == 0
    assert "resumed: 1 part(s)" in capsys.readouterr().err
    assert read_results(out).equals(read_results(root / "one"))
    assert _snapshot(out, True) == _snapshot(root / "one", True)
    assert not (out / BUILD_DIR).exists()


def test_a_rerun_with_other_arguments_does_not_resume_foreign_parts(runs, tmp_path, capsys):
    root, store = runs
    out = tmp_path / "out"
    # parts of an interrupted run of other arguments (another run id) left in the build dir
    shutil.copytree(root / "other" / "results", out / BUILD_DIR)
    (out / BUILD_DIR / "run.json").write_text(json.dumps({"run_id": "0" * 64}))
    assert cli_main(["replay", str(store), *ARGS, "--out", str(out)]) == 0
    assert "resumed" not in capsys.readouterr().err
    assert read_results(out).equals(read_results(root / "one"))


def _refused(out: Path, *words: str) -> str:
    with pytest.raises(UsageError) as info:
        read_results(out)
    msg = str(info.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    return msg


def test_part_of_another_run_is_refused_naming_run_id(runs, tmp_path, capsys):
    root, _ = runs
    out = tmp_path / "mixed"
    shutil.copytree(root / "one", out)
    # the same sequence (same part key) from the run with 3 seeds, every hash re-recorded
    shutil.copyfile(root / "other" / "results" / "parts" / "part-00001.parquet",
                    out / "results" / "parts" / "part-00001.parquet")
    _resign(out)
    _refused(out, "part-00001.parquet", "'run_id'", "another run")
    code = cli_main(["export", str(out), "--format", "csv", "--out", str(tmp_path / "csv")])
    err = capsys.readouterr().err
    assert code == 2 and "part-00001.parquet" in err and "run_id" in err
    assert not (tmp_path / "csv").exists()


@pytest.mark.parametrize("damage, words", [
    ("missing", ("part-00002.parquet", "missing")),
    ("truncated", ("part-00002.parquet", "'sha256'")),
    ("edited", ("part-00002.parquet", "'sha256'")),
    ("duplicated", ("part-00002.parquet", "'key'")),
    ("unlisted", ("part-00003.parquet", "not listed")),
])
def test_damaged_replay_dataset_is_refused_naming_the_part(runs, tmp_path, damage, words):
    root, _ = runs
    out = tmp_path / damage
    shutil.copytree(root / "one", out)
    parts = out / "results" / "parts"
    target = parts / "part-00002.parquet"
    if damage == "missing":
        target.unlink()
    elif damage == "truncated":
        target.write_bytes(target.read_bytes()[:-100])
    elif damage == "edited":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 1
        target.write_bytes(bytes(data))
    elif damage == "duplicated":  # part 1 copied over part 2 and re-recorded
        shutil.copyfile(parts / "part-00001.parquet", target)
        _resign(out)
    else:  # a stray part a glob reader would mix in
        shutil.copyfile(target, parts / "part-00003.parquet")
    _refused(out, *words)


def test_peers_dataset_resumes_and_is_refused_when_mixed(tmp_path, capsys):
    from tracesim.analysis.results_io import load_peers

    store = build_store(tmp_path / "s", n_seqs=2, n_layers=1, n_heads=2, n_kv=1, d=8)
    argv = ["peers", str(store), "--peer", "quest,vattention", "--seeds", "2", "--quiet"]
    assert cli_main([*argv, "--out", str(tmp_path / "a")]) == 0
    man = json.loads((tmp_path / "a" / "results" / "manifest.json").read_text())
    assert man["key_columns"][:2] == ["sequence_id", "layer"] and man["n_parts"] == 2
    df = load_peers([tmp_path / "a"])
    assert len(df) == man["n_rows"] and set(df.config_id) == set(man["config_ids"])
    assert cli_main([*argv[:-2], "3", "--quiet", "--out", str(tmp_path / "b")]) == 0
    shutil.copyfile(tmp_path / "b" / "results" / "parts" / "part-00000.parquet",
                    tmp_path / "a" / "results" / "parts" / "part-00000.parquet")
    _resign(tmp_path / "a")
    with pytest.raises(UsageError, match="part-00000.parquet.*'run_id'"):
        load_peers([tmp_path / "a"])


def test_dask_duckdb_and_pandas_read_the_parts_directly(runs):
    dd = pytest.importorskip("dask.dataframe")  # the cluster extra
    duckdb = pytest.importorskip("duckdb")
    import pandas as pd

    root, _ = runs
    parts = root / "one" / "results" / "parts"
    want = read_results(root / "one")
    n, total = want.num_rows, float(pa.compute.sum(want["err2"]).as_py())
    frame = dd.read_parquet(str(parts), columns=["config_id", "err2"])
    assert int(frame.err2.count().compute()) == n
    assert float(frame.err2.sum().compute()) == pytest.approx(total, rel=1e-12)
    row = duckdb.connect().execute(
        "SELECT count(*), sum(err2) FROM read_parquet(?)", [str(parts / "*.parquet")]).fetchone()
    assert row[0] == n and row[1] == pytest.approx(total, rel=1e-12)
    df = pd.read_parquet(parts, columns=["err2"])
    assert len(df) == n and df.err2.sum() == pytest.approx(total, rel=1e-12)


def test_scale_benchmark_builder_writes_a_dataset_the_readers_verify(tmp_path):
    import importlib.util

    from tests.sweep_fixtures import build_sweep_store
    from tracesim.sweep import run_sweep

    build_sweep_store(tmp_path / "store", n_seqs=2, n_layers=1)
    (tmp_path / "spec.yaml").write_text(
        "store: store\nlayers: all\ngrid:\n  score: [snapkv]\n  design: [topk, poisson]\n"
        "  budget: [0.5]\n  score_params:\n    '*': {window: 6}\nseeds: 2\noutput: out\n")
    run_sweep(tmp_path / "spec.yaml", workers=1, out=tmp_path / "sweep", progress=False)
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_report_scale.py"
    spec = importlib.util.spec_from_file_location("bench_report_scale", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    base = read_results(tmp_path / "sweep")
    rows = bench.scale(tmp_path / "sweep", tmp_path / "scaled", 3)
    scaled = read_results(tmp_path / "scaled")  # verified part by part, keys unique
    assert rows == scaled.num_rows == 3 * base.num_rows
    seqs = set(scaled["sequence_id"].to_pylist())
    assert seqs == {f"{s}{t}" for s in set(base["sequence_id"].to_pylist())
                    for t in ("", "~r1", "~r2")}
    assert pa.compute.sum(scaled["err2"]).as_py() == pytest.approx(
        3 * pa.compute.sum(base["err2"]).as_py(), rel=1e-12)


def test_printed_summary_is_aggregated_batch_by_batch(runs):
    from tracesim.replay.cli import SUMMARY_COLUMNS, summary_table

    root, _ = runs
    table = read_results(root / "one", list(SUMMARY_COLUMNS))
    whole = summary_table(table)
    assert summary_table(table.to_batches(max_chunksize=7)) == whole
    df = table.to_pandas()
    for design, g in df.groupby("design"):  # one configuration per design here
        line = next(x for x in whole.splitlines() if f" {design} " in x)
        assert format(g["err2"].mean(), "10.4g") in line
        assert f"{g['err2'].count():>6}" in line


def test_a_signed_peers_dataset_is_read_without_the_unsigned_warning(tmp_path):
    from tracesim.analysis.report import build_report

    store = build_store(tmp_path / "s", n_seqs=2, n_layers=1, n_heads=2, n_kv=1, d=8)
    assert cli_main(["peers", str(store), "--peer", "vattention", "--seeds", "2", "--quiet",
                     "--out", str(tmp_path / "p")]) == 0
    prereg = Path(__file__).resolve().parents[1] / "data" / "prereg.yaml"
    report = build_report(None, None, prereg_path=prereg, peers_dirs=[tmp_path / "p"])
    assert not any("records no sha256" in n for n in report.notes), report.notes
    (tmp_path / "p" / "results" / "manifest.json").unlink()  # not a dataset: warned, refused
    with pytest.raises((UsageError, ValueError)):
        build_report(None, None, prereg_path=prereg, peers_dirs=[tmp_path / "p"])
