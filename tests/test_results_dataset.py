"""A sweep's results dataset (parts + manifest): readers verify it part by part, refuse a part
that is missing, truncated, edited, duplicated or from another sweep (exit 2, naming the part and
the field), and report the same claims as from the single file of earlier versions."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from tracesim.analysis.results_io import REPORT_COLUMNS, load_results

from tests.sweep_fixtures import MINI_SPEC, build_sweep_store
from tracesim.app.cli import main as cli_main
from tracesim.digests import sha256_file
from tracesim.errors import UsageError
from tracesim.integrity import results_record
from tracesim.sweep import run_sweep

ROOT = Path(__file__).resolve().parents[1]
SPEC = MINI_SPEC


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    root = tmp_path_factory.mktemp("dataset")
    build_sweep_store(root / "store", n_seqs=2, n_layers=2)
    (root / "spec.yaml").write_text(SPEC)
    run_sweep(root / "spec.yaml", workers=1, out=root / "a", progress=False)
    other = SPEC.replace("seeds: 2", "seeds: 3")  # another sweep: same tasks, other rows
    (root / "other.yaml").write_text(other)
    run_sweep(root / "other.yaml", workers=1, out=root / "b", progress=False)
    return root


def _copy(sweeps: Path, tmp_path: Path, name: str = "a") -> Path:
    dst = tmp_path / "sweep"
    shutil.copytree(sweeps / name, dst)
    return dst


def _resign(sweep: Path, edit=None) -> None:
    """Re-record the manifest (after ``edit(manifest)``) and the summary's sha256 of it, as an
    adversary who knows the layout would."""
    res = sweep / "results"
    man = json.loads((res / "manifest.json").read_text())
    if edit is not None:
        edit(man)
    (res / "manifest.json").write_text(json.dumps(man))
    summary = json.loads((res / "summary.json").read_text())
    summary["results_sha256"] = sha256_file(res / "manifest.json")
    summary["n_rows"] = man["n_rows"]
    summary["config_ids"] = man["config_ids"]
    (res / "summary.json").write_text(json.dumps(summary))


def _refused(sweep: Path, *words: str) -> str:
    with pytest.raises(UsageError) as info:
        load_results(sweep)
    msg = str(info.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    return msg


def test_layout_is_readable_by_plain_parquet_readers(sweeps):
    res = sweeps / "a" / "results"
    man = json.loads((res / "manifest.json").read_text())
    assert man["format"] == "tracesim-results-dataset" and man["n_parts"] == 4
    assert sum(p["rows"] for p in man["parts"]) == man["n_rows"]
    assert sorted(q.name for q in (res / "parts").iterdir()) == [
        Path(p["file"]).name for p in man["parts"]]
    df, summary = load_results(sweeps / "a")
    assert summary["results_file"] == "manifest.json" and len(df) == man["n_rows"]
    # the parts directory read by pyarrow (as DuckDB/polars/Dask would glob it): same rows
    direct = pq.read_table(res / "parts").to_pandas()
    assert direct.equals(df)
    import duckdb

    n = duckdb.sql(f"select count(*) from read_parquet('{res}/parts/*.parquet')").fetchall()[0][0]
    assert n == man["n_rows"]


def test_same_claims_as_the_single_file_of_earlier_versions(sweeps, tmp_path):
    """The claims from the dataset equal those from the same rows compacted into one file and
    signed as earlier versions did (the golden of the in-memory computation)."""
    from tracesim.analysis.report import build_report

    legacy = tmp_path / "legacy"
    (legacy / "results").mkdir(parents=True)
    shutil.copy(sweeps / "a" / "configs.json", legacy / "configs.json")
    table = pq.read_table(sweeps / "a" / "results" / "parts").replace_schema_metadata(None)
    pq.write_table(table, legacy / "results" / "results.parquet")
    summary = json.loads((sweeps / "a" / "results" / "summary.json").read_text())
    summary.update(results_record(legacy / "results" / "results.parquet", table.num_rows,
                                  summary["config_ids"]))
    (legacy / "results" / "summary.json").write_text(json.dumps(summary))
    prereg = ROOT / "data" / "prereg.yaml"
    new = build_report(sweeps / "a", None, prereg_path=prereg, allow_prereg_change=True)
    old = build_report(legacy, None, prereg_path=prereg, allow_prereg_change=True)
    assert [asdict(c) for c in new.claims] == [asdict(c) for c in old.claims]
    assert any(c.verdict != "not evaluated" for c in new.claims)


def test_missing_part(sweeps, tmp_path):
    s = _copy(sweeps, tmp_path)
    (s / "results" / "parts" / "part-00002.parquet").unlink()
    _refused(s, "part-00002.parquet", "missing")


def test_truncated_part(sweeps, tmp_path):
    s = _copy(sweeps, tmp_path)
    p = s / "results" / "parts" / "part-00001.parquet"
    data = p.read_bytes()
    p.unlink()  # a hard link to the task file: write a new file, not through the link
    p.write_bytes(data[: len(data) // 2])
    _refused(s, "part-00001.parquet", "'sha256'")


def test_edited_part_with_every_record_recomputed_is_still_bound_to_its_task(sweeps, tmp_path):
    s = _copy(sweeps, tmp_path)
    p = s / "results" / "parts" / "part-00000.parquet"
    f = pq.ParquetFile(p)
    t = f.read()
    t = t.set_column(t.schema.get_field_index("sequence_id"), "sequence_id",
                     pa.array(["s9"] * t.num_rows))
    p.unlink()
    pq.write_table(t, p)  # keeps the task metadata, so key and spec hash still match

    def fix(man):
        man["parts"][0]["sha256"] = sha256_file(p)
    _resign(s, fix)
    _refused(s, "part-00000.parquet", "'sequence_id'", "'s9'")


def test_duplicated_part(sweeps, tmp_path):
    s = _copy(sweeps, tmp_path)
    parts = s / "results" / "parts"
    shutil.copy(parts / "part-00000.parquet", parts / "part-00004.parquet")
    _refused(s, "part-00004.parquet", "not listed", "'parts'")

    def dup(man):  # listed too, under its own name: the rows' cells repeat
        entry = dict(man["parts"][0], file="parts/part-00004.parquet")
        man["parts"].append(entry)
        man["n_rows"] += entry["rows"]
    _resign(s, dup)
    _refused(s, "part-00004.parquet", "earlier part")


def test_part_from_another_sweep(sweeps, tmp_path):
    s = _copy(sweeps, tmp_path)
    theirs = sweeps / "b" / "results" / "parts" / "part-00001.parquet"
    mine = s / "results" / "parts" / "part-00001.parquet"
    mine.unlink()
    shutil.copy(theirs, mine)
    _refused(s, "part-00001.parquet", "'sha256'")

    def fix(man):  # the adversary re-records sha256 and rows: the part's task still differs
        man["parts"][1]["sha256"] = sha256_file(mine)
        man["n_rows"] += pq.ParquetFile(mine).metadata.num_rows - man["parts"][1]["rows"]
        man["parts"][1]["rows"] = pq.ParquetFile(mine).metadata.num_rows
    _resign(s, fix)
    _refused(s, "part-00001.parquet", "'key'")


def test_manifest_edited_after_the_summary(sweeps, tmp_path):
    s = _copy(sweeps, tmp_path)
    man = s / "results" / "manifest.json"
    man.write_text(man.read_text().replace('"n_rows"', '"n_rows" ', 1))
    _refused(s, "summary.json", "'results_sha256'")


def test_config_ids_without_rows_are_refused(sweeps, tmp_path):
    """#32 family 4: a summary (and manifest) padded with configuration ids that have no rows."""
    s = _copy(sweeps, tmp_path)
    _resign(s, lambda man: man["config_ids"].extend(f"pad{i:06d}" for i in range(1000)))
    _refused(s, "manifest.json", "'config_ids'", "pad000000", "configs.json")
    (s / "configs.json").unlink()  # without the run's configs: still no id without rows
    _refused(s, "manifest.json", "'config_ids'", "pad000000", "no rows")


def _legacy(sweeps: Path, tmp_path: Path, table: pa.Table | None = None) -> Path:
    """The same rows as the single ``results/results.parquet`` of earlier versions, signed."""
    d = _copy(sweeps, tmp_path)
    res = d / "results"
    t = table if table is not None else pq.read_table(res / "parts").replace_schema_metadata(
        None)
    shutil.rmtree(res / "parts")
    (res / "manifest.json").unlink()
    pq.write_table(t, res / "results.parquet")
    summary = json.loads((res / "summary.json").read_text())
    summary.update(results_record(res / "results.parquet", t.num_rows,
                                  pc.unique(t["config_id"]).to_pylist()))
    (res / "summary.json").write_text(json.dumps(summary))
    return d


def test_single_file_of_earlier_versions_still_reads(sweeps, tmp_path):
    d = _legacy(sweeps, tmp_path)
    df, summary = load_results(d)
    assert summary["results_file"] == "results.parquet"
    assert df.equals(load_results(sweeps / "a")[0])


def test_legacy_rows_of_an_unlisted_configuration_are_refused(sweeps, tmp_path):
    """#32 family 4: rows of a configuration that the sweep's configs.json (one level above
    results/) does not list, appended and re-recorded in the summary."""
    t = pq.read_table(sweeps / "a" / "results" / "parts").replace_schema_metadata(None)
    extra = t.slice(0, 10)
    extra = extra.set_column(extra.schema.get_field_index("config_id"), "config_id",
                             pa.array(["forged"] * 10))
    d = _legacy(sweeps, tmp_path, pa.concat_tables([t, extra]))
    _refused(d, "config_id", "configs.json", "forged")


def test_legacy_summary_listing_ids_without_rows(sweeps, tmp_path):
    d = _legacy(sweeps, tmp_path)
    summary = json.loads((d / "results" / "summary.json").read_text())
    summary["config_ids"] += ["ghost"]
    (d / "results" / "summary.json").write_text(json.dumps(summary))
    _refused(d, "summary.json", "'config_ids'", "ghost")


def test_truncated_single_file_names_the_file(sweeps, tmp_path, capsys):
    d = _legacy(sweeps, tmp_path)
    p = d / "results" / "results.parquet"
    p.write_bytes(p.read_bytes()[:1000])
    assert cli_main(["report", str(d), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "results.parquet" in err[0], err


def test_report_exits_2_naming_the_part(sweeps, tmp_path, capsys):
    s = _copy(sweeps, tmp_path)
    (s / "results" / "parts" / "part-00003.parquet").unlink()
    assert cli_main(["report", str(s), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "part-00003.parquet" in err[0], err
    assert not (tmp_path / "rep" / "claims.json").exists()


def test_failed_publication_keeps_the_earlier_results(sweeps, tmp_path, monkeypatch):
    """Disk full while the parts are written: the earlier dataset stays byte-identical and no
    stage is left behind; the next run publishes."""
    import errno

    from tracesim.sweep import dataset

    s = _copy(sweeps, tmp_path)
    res = s / "results"
    before = {p.relative_to(res): p.read_bytes() for p in res.rglob("*") if p.is_file()}
    for task in (s / "tasks").rglob("*.parquet"):  # force a republication of every part
        task.unlink()
    calls = {"n": 0}
    real = dataset._link_or_copy

    def full(src, dst):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        real(src, dst)
    monkeypatch.setattr(dataset, "_link_or_copy", full)
    with pytest.raises(OSError, match="No space"):
        run_sweep(sweeps / "spec.yaml", workers=1, out=s, progress=False)
    after = {p.relative_to(res): p.read_bytes() for p in res.rglob("*") if p.is_file()}
    assert after == before
    assert not [p for p in s.iterdir() if p.name.startswith(".stage.")]
    monkeypatch.setattr(dataset, "_link_or_copy", real)
    summary = run_sweep(sweeps / "spec.yaml", workers=1, out=s, progress=False)
    assert summary.complete and summary.tasks["skipped"] == 4
    assert load_results(s)[0].equals(load_results(sweeps / "a")[0])


def test_frontier_and_export_read_the_dataset(sweeps, tmp_path):
    from tracesim.analysis.frontier_cli import load_frontier_results

    from tracesim.export import export_results

    d = _legacy(sweeps, tmp_path)
    new = load_frontier_results(sweeps / "a")
    old = load_frontier_results(d)
    assert new.equals(old) and list(new.dtypes) == list(old.dtypes)
    out, rows = export_results(sweeps / "a", tmp_path / "csv", "csv")
    assert rows == len(new) and (out / "results.csv").is_file()
    out, rows = export_results(sweeps / "a", tmp_path / "ds", "parquet-dataset")
    assert rows == len(new)
    (sweeps / "a" / "results" / "parts" / "part-00000.parquet").rename(tmp_path / "away")
    try:
        with pytest.raises(ValueError, match="part-00000.parquet"):
            export_results(sweeps / "a", tmp_path / "csv2", "csv")
        with pytest.raises(ValueError, match="part-00000.parquet"):
            load_frontier_results(sweeps / "a")
    finally:
        (tmp_path / "away").rename(sweeps / "a" / "results" / "parts" / "part-00000.parquet")


def test_killed_between_the_two_renames_then_resumed(sweeps, tmp_path):
    """kill -9 after the old results moved aside and before the new took their name: the next
    run removes both stages and republishes from the task files."""
    s = _copy(sweeps, tmp_path)
    (s / "results").rename(s / ".stage.old-results.1.deadbeef.tmp")
    (s / ".stage.results.1.deadbeef.tmp" / "parts").mkdir(parents=True)
    (s / ".stage.results.1.deadbeef.tmp" / "parts" / "part-00000.parquet").write_bytes(b"PAR1")
    summary = run_sweep(sweeps / "spec.yaml", workers=1, out=s, progress=False)
    assert summary.complete and summary.tasks["skipped"] == 4 and summary.tasks["done"] == 0
    assert not [p for p in s.iterdir() if p.name.startswith(".stage.")]
    assert load_results(s)[0].equals(load_results(sweeps / "a")[0])


def test_projection_reads_only_the_columns_asked_for_on_both_layouts(sweeps, tmp_path):
    full = load_results(sweeps / "a")[0]
    asked = [*REPORT_COLUMNS, "not_a_column"]
    kept = [c for c in asked if c in full.columns]
    assert "design_params" in full.columns and "design_params" not in kept
    for d in (sweeps / "a", _legacy(sweeps, tmp_path)):
        df = load_results(d, columns=asked)[0]
        assert list(df.columns) == kept
        assert df.equals(full[kept])


def test_report_columns_cover_every_results_column_the_analysis_code_quotes():
    """A results column a claim, figure or table starts reading must join the report's
    projection, or the report would silently lose it."""
    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "columns.md").read_text()
    section = doc.split("## Replay and sweep results")[1].split("## Evict outcomes")[0]
    documented = set(re.findall(r"^\| *`([a-z_0-9]+)`", section, re.M))
    assert {"err2", "design_params"} <= documented
    quoted = set()
    for src in (root / "analysis").glob("*.py"):
        if src.name != "results_io.py":
            quoted |= set(re.findall(r"[\"']([a-z_0-9]+)[\"']", src.read_text()))
    missing = (documented & quoted) - set(REPORT_COLUMNS)
    assert not missing, f"add {sorted(missing)} to REPORT_COLUMNS"
