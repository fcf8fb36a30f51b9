"""Hostile and careless input, round two: output sets, silent numbers, tampered results.

One generator per family lives in ``tests/integrity_cases.py``; every case runs the real
``tracesim`` command line in one child process under a 1 GiB data cap and must exit 2 within 10
s of CPU time with a one-line message naming the file and the field, no traceback. The child's
peak resident memory (VmHWM) stays under the cap, and every file that existed before (stores,
replay outputs, tampered copies) is byte-identical afterwards. The commit of a file set is also
checked in-process with a failure injected between two renames.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fault_harness import check_family, check_memory_and_inputs, run_suite
from tests.integrity_cases import FAMILIES, all_cases, build_inputs


@pytest.fixture(scope="module")
def integrity(tmp_path_factory):
    """Inputs, every case, and the child's results (run once for the module)."""
    return run_suite("tests.integrity_cases",
                     tmp_path_factory.mktemp("integrity"),
                     build_inputs, all_cases)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_exits_2_naming_file_and_field(integrity, family):
    check_family(integrity, family, 5, "integrity")


def test_peak_memory_and_earlier_outputs(integrity):
    new = check_memory_and_inputs(integrity, "integrity")
    # a refused command leaves nothing new but its own outs/ entry (and lock files)
    assert all(k.startswith("outs/") or k.endswith(".tracesim.lock") for k in new), new


# --------------------------------------------------------------------------- in-process


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def test_a_failure_between_two_renames_rolls_the_set_back(tmp_path, monkeypatch):
    from tracesim import atomic

    out = tmp_path / "out"
    out.mkdir()
    names = ["a.parquet", "b.json", "summary.json"]
    for n in names[:2]:  # an earlier set (summary.json did not exist yet)
        (out / n).write_bytes(f"old {n}".encode())
    before = _files(out)
    real, calls = os.replace, []

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == 3:  # the first two files are in place: fail on the third
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", flaky)
    with pytest.raises(OSError), atomic.atomic_files(out, names) as stage:
        for n in names:
            (stage / n).write_bytes(f"new {n}".encode())
    monkeypatch.setattr(atomic.os, "replace", real)
    assert _files(out) == before
    assert sorted(p.name for p in out.iterdir()) == sorted(before)  # no stage left behind
    with atomic.atomic_files(out, names) as stage:  # and a clean commit replaces all three
        for n in names:
            (stage / n).write_bytes(f"new {n}".encode())
    assert _files(out) == {n: f"new {n}".encode() for n in names}


def test_an_exception_while_staging_changes_nothing_and_stale_stages_are_removed(tmp_path):
    from tracesim import atomic

    out = tmp_path / "out"
    out.mkdir()
    (out / "r.parquet").write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt), atomic.atomic_files(out, ["r.parquet"]) as stage:
        (stage / "r.parquet").write_bytes(b"half")
        raise KeyboardInterrupt
    assert _files(out) == {"r.parquet": b"old"}
    assert [p.name for p in out.iterdir()] == ["r.parquet"]
    stale = out / f"{atomic.STAGE_PREFIX}123.deadbeef{atomic.TMP_SUFFIX}"  # a killed run's
    stale.mkdir()
    (stale / "r.parquet").write_bytes(b"x")
    assert atomic.remove_stale_tmp(out) == 1 and not stale.exists()


def test_trust_unsigned_reports_with_a_warning(integrity, tmp_path):
    """The documented acceptance: older results without a record, with --trust-unsigned."""
    from tracesim.analysis.report import load_results

    notes: list[str] = []
    df, _ = load_results(integrity["paths"]["unsigned"], trust_unsigned=True, notes=notes)
    assert len(df) > 0 and len(notes) == 1 and "UNSIGNED" in notes[0]
    df2, summary = load_results(integrity["paths"]["replay"])  # signed by replay itself
    assert summary["n_rows"] == len(df2)


def test_a_summary_with_mistyped_config_ids_is_a_user_error(tmp_path):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tracesim.errors import UsageError
    from tracesim.integrity import sign_results, verify_results

    path = tmp_path / "results.parquet"
    table = pa.table({"config_id": ["a"], "score": ["s"], "design": ["d"], "sequence_id": ["q"],
                      "layer": [0], "head": [0], "query_index": [0], "err2": [0.1],
                      "wald_cov": [1.0]})
    pq.write_table(table, path)
    doc = sign_results(path)
    doc["config_ids"] = [[1]]  # hostile: a list inside the list
    (tmp_path / "summary.json").write_text(json.dumps(doc))
    with pytest.raises(UsageError, match="'config_ids' is not a list of strings"):
        verify_results(path, table, doc, tmp_path / "summary.json")
