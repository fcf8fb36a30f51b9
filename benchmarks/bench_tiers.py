"""Tiers simulator: the compiled kernel against the numpy reference, side by side.

For each context length a synthetic one-layer store (``tracesim synth --positions N --layers 1``,
64 decode steps) is simulated by :func:`tracesim.tiers.simulate_layer` (numba) and by
:func:`tracesim.tiers.reference.simulate_layer_reference` (numpy), alternated for ``--rounds``
rounds in one process; the report gives the medians and their ratio, with the load average
beside every round. Base policy SnapKV x Poisson (mixture 0.1) x Hájek at 25%, 1 seed, every
scheduler, fetch budgets 0, 0.02, 0.1 and 1, pages of 16 positions.

Usage: ``python benchmarks/bench_tiers.py [--positions 4096,32768] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.protocol import load_average  # noqa: E402


def main(argv: list[str] | None = None) -> dict[int, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--positions", default="4096,32768", help="comma-separated context lengths")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    from tracesim.policies import make_policy
    from tracesim.replay import load_layer
    from tracesim.store import open_store
    from tracesim.tiers import SCHEDULERS, MemoryModel, simulate_layer
    from tracesim.tiers.reference import simulate_layer_reference

    policy = make_policy("snapkv", "poisson", 0.25, design_params={"mixture": 0.1})
    ratios = {}
    print("| positions | kernel (s) | numpy reference (s) | ratio |\n|---|---|---|---|")
    for n in (int(x) for x in args.positions.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "store"
            subprocess.run([sys.executable, "-m", "tracesim.app.cli", "synth",
                            "--positions", str(n), "--layers", "1", "--quiet", "--out",
                            str(path)], check=True, cwd=ROOT)
            store = open_store(path)
            trace = load_layer(store, store[store.sequence_ids[0]], 0)
        call = (trace, policy, np.arange(1), 30, MemoryModel(page=16), SCHEDULERS,
                np.array([0.0, 0.02, 0.1, 1.0]))
        simulate_layer(*call)  # compile (or load the cached kernel) outside the timing
        times: dict[str, list[float]] = {"kernel": [], "numpy": []}
        for r in range(args.rounds):
            for name, fn in (("kernel", simulate_layer), ("numpy", simulate_layer_reference)):
                t0 = time.perf_counter()
                fn(*call)
                times[name].append(time.perf_counter() - t0)
            print(f"  {n} round {r + 1}: kernel {times['kernel'][-1]:.2f} s, numpy "
                  f"{times['numpy'][-1]:.2f} s; load average {os.getloadavg()[0]:.2f}",
                  file=sys.stderr, flush=True)
        k, p = statistics.median(times["kernel"]), statistics.median(times["numpy"])
        ratios[n] = p / k
        print(f"| {n:,} | {k:.2f} | {p:.2f} | {p / k:.1f}x |", flush=True)
    print(f"load average at the end: {load_average()}")
    return ratios


if __name__ == "__main__":
    main()
