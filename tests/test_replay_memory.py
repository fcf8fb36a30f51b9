"""Replay memory is bounded by one layer, not by the store (run in a fresh process).

Peak memory is the child's own ``VmHWM`` (``benchmarks.protocol.peak_rss_mb``), never its
``ru_maxrss``: Linux carries the parent's high-water mark (pytest's, with torch loaded) into a
child across fork and exec, which made the 128k figure depend on the tests that ran before it.
The first two tests check the measurement itself, under a parent that holds 2 GB.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A child that reports its peak with and without a 500 MiB array of its own.
CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, {repo!r})
from benchmarks.protocol import peak_rss_mb, rss_mb
held = np.ones(int(sys.argv[1]) << 17) if int(sys.argv[1]) else None  # touched float64s
print(json.dumps({{"peak": peak_rss_mb(), "rss": rss_mb()}}))
"""
# A parent that holds (touches) 2 GiB, then starts the two children and prints their reports.
PARENT = """
import subprocess, sys
import numpy as np
hold = np.ones(2048 << 17)
for mb in ("0", "500"):
    out = subprocess.run([sys.executable, "-c", sys.argv[1], mb], capture_output=True,
                         text=True, check=True).stdout
    print(out.strip())
"""


def _children_under(parent_code: str | None) -> list[dict]:
    child = CHILD.format(repo=str(REPO))
    if parent_code is None:
        return [json.loads(subprocess.run([sys.executable, "-c", child, mb], capture_output=True,
                                          text=True, check=True, timeout=120).stdout)
                for mb in ("0", "500")]
    proc = subprocess.run([sys.executable, "-c", parent_code, child], capture_output=True,
                          text=True, check=True, timeout=300)
    return [json.loads(line) for line in proc.stdout.strip().splitlines()]


@pytest.mark.parametrize("parent", ["pytest", "2 GiB"])
def test_peak_memory_is_the_childs_own(parent):
    small, big = _children_under(None if parent == "pytest" else PARENT)
    # The 500 MiB array shows up as ~500 MiB more peak, whatever the parent held.
    assert 450 < big["peak"] - small["peak"] < 550, (small, big)
    # A bare interpreter with numpy is far below the 2 GiB its parent holds.
    assert small["peak"] < 400, small
    assert small["peak"] >= small["rss"] > 0


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
    # add seeds x 3 x P x 8 bytes: 100 MB more at 32 seeds). The child's own peak (VmHWM).
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
