"""Replay time per row: a per-step design against the prefill design at the same budget.

One SmolLM2-shaped synthetic layer (9 query heads, 3 KV heads, d = 64, ``--positions``
positions, 32 question-window and ``--decode`` decode queries; the layer of
``bench_long_context.py``), 25 % budget, Poisson (mixture 0.1), ``--seeds`` seeds, output
space off. A: SnapKV (one-shot, question window). B: ``perstep`` with ``--proxy`` (a fresh
sample at every decode step). The two alternate for ``--rounds`` rounds (A, B, A, B, ...);
each round prints both times (wall, and the process's CPU time: on a shared machine the CPU
time is the steadier guide) and the load, the summary the median per-round ratio B / A of each.
Rows are the same in both (heads x decode queries x seeds), so the time ratio is the ratio
per row.

Usage: ``python benchmarks/bench_perstep.py [--positions 4096 --decode 64 --seeds 32
--rounds 5 --proxy quant:4]``

``--inloop-simhash`` times instead what the in-loop per-step design spends on its SimHash
proxy (``simhash:10,150``) over ``--decode`` steps of one layer (3 KV heads): each step is a
new trace of the cache ``[0, t]``, as ``tracesim.capture.inloop.perstep`` builds it, scored by
the per-step score; codes carried from step to step (``carry``) alternate with codes rebuilt
at every step (``rebuild``, the previous behaviour).
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
    ap.add_argument("--inloop-simhash", action="store_true",
                    help="time the in-loop SimHash scoring, codes carried vs rebuilt")
    args = ap.parse_args(argv)
    if args.inloop_simhash:
        return inloop_simhash(args.positions, args.decode, args.rounds)
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
    cpu: dict[str, list[float]] = {"prefill": [], "perstep": []}
    for r in range(args.rounds):
        for name, pols in (("prefill", prefill), ("perstep", perstep)):
            trace = long_layer(args.positions, n_decode=args.decode)  # no cached attention
            t, c = time.perf_counter(), time.process_time()
            res = replay_layer(trace, pols, seeds, n_layers=30, options=opts)
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
            assert np.isfinite(res.out[..., 0]).all()
        print(f"round {r + 1}: prefill {times['prefill'][-1]:.2f} s, per-step "
              f"{times['perstep'][-1]:.2f} s (CPU {cpu['prefill'][-1]:.2f} s, "
              f"{cpu['perstep'][-1]:.2f} s); load {load_average()}", flush=True)
    ratio = median_ratio(times["perstep"], times["prefill"])
    cpu_ratio = median_ratio(cpu["perstep"], cpu["prefill"])
    print(f"P = {args.positions}, {args.decode} decode queries, {args.seeds} seeds, proxy "
          f"{args.proxy}: per-step / prefill time per row = {ratio:.2f} (median of "
          f"{args.rounds} alternated rounds; prefill median {np.median(times['prefill']):.2f} s,"
          f" per-step {np.median(times['perstep']):.2f} s); by CPU time {cpu_ratio:.2f}")
    return {"ratio": ratio, "cpu_ratio": cpu_ratio, **times}


def _step_trace(trace, end: int):
    """The layer as the in-loop cache holds it at the step of position ``end``."""
    from tracesim.layer_trace import LayerTrace

    keep = trace.query_positions <= end
    return LayerTrace(layer=trace.layer, keys=trace.keys[:, :end + 1].copy(),
                      values=trace.values[:, :end + 1].copy(), queries=trace.queries[:, keep],
                      h2o=trace.h2o[:, :end + 1].copy(),
                      query_positions=trace.query_positions[keep],
                      query_roles=[r for r, k in zip(trace.query_roles, keep, strict=True) if k],
                      prompt_length=trace.prompt_length, question_start=trace.question_start,
                      scale=trace.scale)


def inloop_simhash(positions: int, steps: int, rounds: int) -> dict:
    """Seconds per layer of in-loop SimHash scoring over ``steps`` steps, carried vs rebuilt."""
    from tracesim.policies import make_score
    from tracesim.proxies.base import carry_summaries, proxy_summaries

    score = make_score("perstep", proxy="simhash:10,150")
    trace = long_layer(positions, n_decode=steps)
    ends = [int(t) for t, r in zip(trace.query_positions, trace.query_roles, strict=True)
            if r == "decode"]

    def run(carry: bool) -> float:
        held: dict = {}
        t0 = time.perf_counter()
        for end in ends:
            step = _step_trace(trace, end)
            if carry:
                carry_summaries(held, step)
            for g in range(step.n_kv_heads):
                score.scores(step, g, end)
            held = proxy_summaries(step)
        return time.perf_counter() - t0

    run(True)
    times: dict[str, list[float]] = {"carry": [], "rebuild": []}
    for r in range(rounds):
        for name in ("carry", "rebuild"):
            times[name].append(run(name == "carry"))
        print(f"round {r + 1}: carried {times['carry'][-1]:.2f} s, rebuilt "
              f"{times['rebuild'][-1]:.2f} s; load {load_average()}", flush=True)
    ratio = median_ratio(times["rebuild"], times["carry"])
    print(f"in-loop simhash:10,150, P = {positions}, {len(ends)} steps x 3 KV heads: rebuilt / "
          f"carried = {ratio:.1f}x (median of {rounds} alternated rounds; carried median "
          f"{np.median(times['carry']):.2f} s, rebuilt {np.median(times['rebuild']):.2f} s)")
    return {"ratio": ratio, **times}


if __name__ == "__main__":
    main()
