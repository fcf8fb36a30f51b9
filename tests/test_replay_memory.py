"""Replay memory is bounded by one layer, not by the store (run in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_peak_memory_is_bounded_by_one_layer():
    # 48 layers x 2048 positions: a ~100 MB store; the working set is a few layers' worth.
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_memory.py"), "--layers", "48",
         "--positions", "2048", "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=300, check=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(r)
    assert r["store_mb"] > 90
    assert r["anon_growth_mb"] < r["store_mb"] / 4, r
    # One layer's float64 working set is ~4-5x its float32 storage; allow that, not more.
    assert r["anon_growth_mb"] < 8 * r["layer_mb"] + 16, r
