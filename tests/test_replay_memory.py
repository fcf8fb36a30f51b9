"""Replay memory is bounded by one layer, not by the store (run in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_one_layer_at_128k_positions_stays_within_2_gb():
    # 9 heads / 3 KV heads, 64 decode queries, output space on; reduced seeds (the uniforms
    # add seeds x 3 x P x 8 bytes: 100 MB more at 32 seeds). Peak RSS of a fresh process.
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_long_context.py"), "--positions",
         "131072", "--decode", "64", "--seeds", "2", "--policies",
         "snapkv:poisson,h2o:bernoulli", "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=900, check=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(r)
    assert r["finite"], r
    assert r["peak_rss_mb"] < 2048, r
    # The replay itself (beyond the layer's own float64 K/V and the interpreter) stays well
    # under the 2 GB: no (heads x queries x P) float64 buffer (9 x 96 x 131072 x 8 = 906 MB).
    assert r["peak_rss_mb"] - r["rss_layer_built_mb"] < 900, r
