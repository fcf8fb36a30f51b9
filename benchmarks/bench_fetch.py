"""In-loop fetch decisions: the decode cost of fetching against plain eviction.

SmolLM2 (``tracesim.capture.models``, CPU) prefills ``--context`` random tokens once; SnapKV x
Poisson
(mixture 0.1) x Hájek at 25% plans the kept sets, as ``tracesim evict`` does. Each round then
decodes ``--steps`` tokens greedily (EOS ignored) under plain eviction and under every
``--fetch`` scheduler at ``--budget`` (a fraction of each layer's evicted bytes), alternated in
that order. The report gives the median per decode step of each variant and the median over
rounds of its ratio to plain eviction in the same round, with ``os.getloadavg()`` printed beside
every round.

Plain eviction already runs the one-pass certified attention; a fetch step adds the scheduler's
decision (``tracesim.tiers.step``: the offline simulator's compiled step, float64, on the host)
and runs the one-pass attention with the fetched pages' bias instead of the plain one.

Usage: ``python benchmarks/bench_fetch.py [--context 1024 --steps 8 --rounds 3 --threads 2
    --fetch certificate_bound,bound,random --budget 0.1]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.protocol import load_average, median_ratio  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fetch", default="certificate_bound,bound,random")
    ap.add_argument("--budget", type=float, default=0.1)
    args = ap.parse_args(argv)
    import torch
    from tracesim.capture.inloop.evict import decode_policy, layer_plans, prefill_sequence
    from tracesim.capture.inloop.fetch import FetchConfig
    from tracesim.capture.models import load_model, model_info

    from tracesim.policies import make_policy

    torch.set_num_threads(args.threads)
    print(f"load average at start: {load_average()}", flush=True)
    model = load_model("smollm2").model
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (args.context,), generator=gen).tolist()
    pre = prefill_sequence(model, ids, question_start=args.context - 32,
                           scaling=model_info(model)["scaling"])
    policy = make_policy("snapkv", "poisson", 0.25, design_params={"mixture": 0.1})
    plans = layer_plans(pre.traces, policy, 0)
    variants: dict[str, FetchConfig | None] = {"plain eviction": None}
    for name in args.fetch.split(","):
        variants[f"fetch {name} {args.budget:g}"] = FetchConfig(name, args.budget)

    def decode(fetch: FetchConfig | None) -> float:
        t = time.perf_counter()
        r = decode_policy(model, pre, plans, args.steps, set(), policy, 0, fetch=fetch)
        assert len(r.generated_ids) == args.steps
        return (time.perf_counter() - t) / args.steps

    for fetch in variants.values():  # warm-up
        decode(fetch)
    per_step: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, fetch in variants.items():
            per_step[name].append(decode(fetch))
        print(f"round {r + 1}: " + ", ".join(f"{n} {t[-1] * 1e3:.0f} ms/step"
                                             for n, t in per_step.items())
              + f"; load average {load_average()}", flush=True)
    base = per_step["plain eviction"]
    medians = {name: statistics.median(t) for name, t in per_step.items()}
    print(f"\ncontext {args.context}, {args.steps} decode steps, torch threads "
          f"{torch.get_num_threads()}; medians of {args.rounds} alternated rounds")
    print("| variant | ms per decode step | vs plain eviction (median per-round ratio) |")
    print("|---|---|---|")
    for name, t in per_step.items():
        ratio = median_ratio(t, base)
        print(f"| {name} | {medians[name] * 1e3:.1f} | {ratio:.2f}x |")
    print(f"load average at the end: {load_average()}")
    return medians


if __name__ == "__main__":
    main()
