"""Replay time per row: a per-step design against the prefill design at the same budget.

One SmolLM2-shaped synthetic layer (9 query heads, 3 KV heads, d = 64, ``--positions``
positions, 32 question-window and ``--decode`` decode queries; the layer of
``bench_long_context.py``), 25 % budget, Poisson (mixture 0.1), ``--seeds`` seeds, output
space off. A: SnapKV (one-shot, question window). B: ``perstep`` with ``--proxy`` (a fresh
sample at every decode step). The two alternate for ``--rounds`` rounds (A, B, A, B, ...);
each round prints both times and the load, the summary the median per-round ratio B / A.
Rows are the same in both (heads x decode queries x seeds), so the time ratio is the ratio
per row.

Usage: ``python benchmarks/bench_perstep.py [--positions 4096 --decode 64 --seeds 32
--rounds 5 --proxy quant:4]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_long_context import long_layer  # noqa: E402
from benchmarks.protocol import load_average, median_ratio  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--proxy", default="quant:4")
    args = ap.parse_args(argv)
    from tracesim.policies import make_policy
    from tracesim.replay import ReplayOptions, replay_layer

    opts = ReplayOptions(output_space=False)
    dp = {"mixture": 0.1}
    prefill = [make_policy("snapkv", "poisson", 0.25, design_params=dp,
                           score_params={"window_source": "question"})]
    perstep = [make_policy("perstep", "poisson", 0.25, schedule="step", design_params=dp,
                           score_params={"proxy": args.proxy})]
    seeds = np.arange(args.seeds)
    warm = long_layer(512, n_decode=4)
    for pols in (prefill, perstep):  # compile or load the kernels, untimed
        replay_layer(warm, pols, seeds[:2], n_layers=30, options=opts)
    times: dict[str, list[float]] = {"prefill": [], "perstep": []}
    for r in range(args.rounds):
        for name, pols in (("prefill", prefill), ("perstep", perstep)):
            trace = long_layer(args.positions, n_decode=args.decode)  # no cached attention
            t = time.perf_counter()
            res = replay_layer(trace, pols, seeds, n_layers=30, options=opts)
            times[name].append(time.perf_counter() - t)
            assert np.isfinite(res.out[..., 0]).all()
        print(f"round {r + 1}: prefill {times['prefill'][-1]:.2f} s, per-step "
              f"{times['perstep'][-1]:.2f} s; load {load_average()}", flush=True)
    ratio = median_ratio(times["perstep"], times["prefill"])
    print(f"P = {args.positions}, {args.decode} decode queries, {args.seeds} seeds, proxy "
          f"{args.proxy}: per-step / prefill time per row = {ratio:.2f} (median of "
          f"{args.rounds} alternated rounds; prefill median {np.median(times['prefill']):.2f} s,"
          f" per-step {np.median(times['perstep']):.2f} s)")
    return {"ratio": ratio, **times}


if __name__ == "__main__":
    main()
