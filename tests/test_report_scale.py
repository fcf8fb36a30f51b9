"""``tracesim report`` on 10^6 rows in a child process, under a memory cap on its process tree.

A small sweep's results dataset is replicated with renamed sequences (the report benchmark's
builder, ``benchmarks/bench_report_scale.py``: new clusters, re-recorded part records, manifest
and summary), so the report verifies and reads it as a sweep's. The child's peak memory is the
sum of ``VmHWM`` over its process tree, read from ``/proc`` while it runs. Replicating every
sequence leaves each pooled proportion and each mean over sequences as it was, so those
estimates must equal the unreplicated report's; only intervals (more clusters) may change.

Slow (about a minute on 2 cores): the sweep itself starts worker processes, and the report
reads 10^6 rows; the 10^7 and 10^8-row figures are the benchmark's (docs/report.md).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from tracesim.analysis.aggregate import open_results
from tracesim.analysis.claims_gating import evaluate_c5
from tracesim.analysis.claims_replay import evaluate_c1, evaluate_c2_attention
from tracesim.analysis.prereg import load_prereg

from benchmarks import bench_report_scale as scale_bench
from tests.sweep_fixtures import build_sweep_store

ROOT = Path(__file__).resolve().parents[1]
#: The issue's cap for the report's whole process tree.
CAP_MB = 1536
ROWS = 1_000_000
SPEC = """\
name: scale
store: store
layers: all
grid:
  score: [snapkv, random]
  design: [topk, poisson]
  budget: [0.3, 0.45, 0.6]
  score_params:
    "*": {window: 6}
seeds: 8
record: per_seed
partition:
  layers_per_task: 2
output: out
"""
#: Claims whose estimate is a pooled proportion or a mean over sequences: the same on every
#: copy of the sequences.
UNCHANGED_BY_COPIES = ("C1", "C2")


def _claims(report_dir: Path) -> dict[str, dict]:
    """``claims.json`` of a report, by claim id."""
    return {c["claim"]: c for c in json.loads((report_dir / "claims.json").read_text())}


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_report_on_a_million_rows_stays_under_the_memory_cap(tmp_path):
    from tracesim.sweep import run_sweep

    build_sweep_store(tmp_path / "store", n_seqs=3, n_layers=2)
    (tmp_path / "spec.yaml").write_text(SPEC)
    run_sweep(tmp_path / "spec.yaml", workers=1, out=tmp_path / "base", progress=False)
    base_rows = json.loads((tmp_path / "base" / "results" / "manifest.json").read_text())[
        "n_rows"]
    copies = math.ceil(ROWS / base_rows)
    rows = scale_bench.scale(tmp_path / "base", tmp_path / "scaled", copies)
    assert rows >= ROWS

    big = scale_bench.run_report(tmp_path / "scaled", tmp_path / "report-scaled")
    assert big["rc"] == 0, big
    assert 0 < big["peak_mb"] <= CAP_MB, big

    # the unreplicated table's claims, computed in this process from its aggregates
    prereg = load_prereg(ROOT / "data" / "prereg.yaml")
    base = open_results(tmp_path / "base")
    try:
        one = {"C1": evaluate_c1(base, prereg)[0], "C2": evaluate_c2_attention(base, prereg),
               "C5": evaluate_c5(base, prereg)}
    finally:
        base.close()
    many = _claims(tmp_path / "report-scaled")
    for cid in UNCHANGED_BY_COPIES:
        a, b = one[cid].estimate, many[cid]["estimate"]
        assert one[cid].verdict != "not evaluated" and math.isfinite(a), cid
        assert abs(a - b) <= 1e-9 * max(abs(a), abs(b)), (cid, a, b)
    # C5 ranks every copy's units together (ties between copies broken by sequence order):
    # its per-sequence means move only at the gating boundary
    assert one["C5"].verdict != "not evaluated" and math.isfinite(many["C5"]["estimate"])
    assert abs(many["C5"]["estimate"] - one["C5"].estimate) <= 0.05 * max(
        abs(one["C5"].estimate), 1e-3)
    # more clusters narrow the intervals of the pooled estimates; they do not widen them
    for cid in UNCHANGED_BY_COPIES:
        assert (many[cid]["ci_high"] - many[cid]["ci_low"]
                <= one[cid].ci_high - one[cid].ci_low + 1e-12), cid
