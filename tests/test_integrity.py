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

from tests.fault_harness import LIMIT_S, MEMORY_CAP, problems, run_child, snapshot
from tests.integrity_cases import FAMILIES, all_cases, build_inputs


@pytest.fixture(scope="module")
def integrity(tmp_path_factory):
    """Inputs, every case, and the child's results (run once for the module)."""
    root = tmp_path_factory.mktemp("integrity")
    paths = build_inputs(root / "in")
    cases = all_cases(paths)
    before = snapshot(root / "in")
    doc, wall = run_child("tests.integrity_cases", root, cases)
    return {"root": root, "paths": paths, "cases": cases, "doc": doc, "before": before,
            "after": snapshot(root / "in"), "wall": wall}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_exits_2_naming_file_and_field(integrity, family):
    by_name = {r["name"]: r for r in integrity["doc"]["cases"]}
    cases = [c for c in integrity["cases"] if c["family"] == family]
    assert len(cases) >= 5
    bad = []
    for case in cases:
        result = by_name[case["name"]]
        found = problems(case, result)
        if found:
            bad.append(f"{case['name']}: {', '.join(found)}: {result['message'][-300:]!r}")
    slowest = max(by_name[c["name"]]["seconds"] for c in cases)
    print(f"\n[integrity] family {family}: {len(cases) - len(bad)}/{len(cases)} exit 2 naming "
          f"the file and field; slowest {slowest:.2f} s (limit {LIMIT_S:.0f} s)")
    assert not bad, "\n".join(bad)


def test_peak_memory_and_earlier_outputs(integrity):
    kb = integrity["doc"]["vmhwm_kb"]
    print(f"\n[integrity] {len(integrity['cases'])} cases in one child: peak RSS "
          f"{kb / 1024:.0f} MiB (cap {MEMORY_CAP >> 20} MiB), {integrity['wall']:.1f} s wall")
    assert 0 < kb * 1024 < MEMORY_CAP
    before, after = integrity["before"], integrity["after"]
    assert set(before) <= set(after), sorted(set(before) - set(after))
    changed = [k for k in before if before[k] != after[k]]
    assert not changed, changed
    new = sorted(set(after) - set(before))
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
    from analysis.report import load_results

    notes: list[str] = []
    df, _ = load_results(integrity["paths"]["unsigned"], trust_unsigned=True, notes=notes)
    assert len(df) > 0 and len(notes) == 1 and "UNSIGNED" in notes[0]
    df2, summary = load_results(integrity["paths"]["replay"])  # signed by replay itself
    assert summary["n_rows"] == len(df2)
