"""Replay vs re-running SmolLM2 for the same (policy, seed) configurations.

Side by side in one run:

- ``rerun``: what evaluating one configuration in the loop costs at least — SmolLM2 (via
  ``tracesim.capture.models``, SDPA, CPU) decodes ``--decode`` steps after a shared, cached
  prefill, with
  the configuration's eviction as an additive ``-inf`` mask; the cache is cropped back after
  each run. The prefill is *not* charged to any configuration (one-shot compression does not
  change it), so this is a lower bound on the rerun cost. A few runs are timed per round and
  their mean is multiplied by the number of (policy, seed) pairs.
- ``replay``: :func:`tracesim.replay.replay` of the same policies and seeds over every layer of
  one sequence with the same context, read from disk: by default a synthetic store with
  SmolLM2's shapes (30 layers, 9/3 heads, d=64) and random tensors (replay cost depends on the
  shapes and budgets, not on the values); ``--traces DIR`` uses a real store instead (its
  first sequence; the rerun uses ``--context``, so match them).

They do not produce the same thing: a rerun gives closed-loop generations, the replay gives
open-loop attention errors and certificates for every layer, head and query. This compares cost.

Protocol: the model is loaded and the prefill run once; then ``--rounds`` rounds alternate the
replay of every pair and ``--runs`` timed reruns. The report gives medians over rounds, the
median of the per-round ratios, and the load average beside every round.

Usage: ``python benchmarks/bench_rerun.py [--context 1024 --decode 16 --seeds 32 --rounds 3]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.protocol import load_average  # noqa: E402
from tracesim.policies import policy_grid  # noqa: E402
from tracesim.replay import replay  # noqa: E402
from tracesim.store import open_store  # noqa: E402


def synthetic_smollm2_store(path: Path, context: int, n_decode: int) -> None:
    """A store with SmolLM2's shapes (30 layers, 9/3 heads, d=64) and random tensors."""
    from benchmarks.bench_memory import write_store

    write_store(path, n_layers=30, P=context + n_decode, n_heads=9, n_kv=3, d=64,
                n_decode=n_decode)


class Rerun:
    """SmolLM2 on CPU with a cached prefill of ``context`` random tokens; :meth:`seconds` times
    configurations decoded after it."""

    def __init__(self, context: int, n_decode: int, threads: int) -> None:
        import torch
        from tracesim.capture.generate import cache_keyword
        from tracesim.capture.models import load_model
        from transformers import DynamicCache

        torch.set_num_threads(threads)
        self.context, self.n_decode = context, n_decode
        self.model = load_model("smollm2", attn_implementation="sdpa").model
        self.kw = cache_keyword(self.model)
        self.gen = torch.Generator().manual_seed(0)
        ids = torch.randint(100, 20000, (1, context), generator=self.gen)
        self.cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            t = time.perf_counter()
            out = self.model(input_ids=ids, position_ids=torch.arange(context)[None],
                             use_cache=True, logits_to_keep=1, **{self.kw: self.cache})
            self.prefill = time.perf_counter() - t
        self.first = out.logits[0, -1].argmax().view(1, 1)

    def seconds(self, runs: int) -> float:
        """Mean seconds of one configuration: ``runs`` random 25% evictions, each decoding
        ``n_decode`` steps with an additive ``-inf`` mask; the cache is cropped back after each."""
        import torch

        context, times = self.context, []
        with torch.inference_mode():
            for _ in range(runs):
                keep = torch.rand(context, generator=self.gen) < 0.25
                keep[:4] = True
                keep[-32:] = True
                tok = self.first
                t = time.perf_counter()
                for step in range(self.n_decode):
                    mask = torch.zeros(1, 1, 1, context + step + 1)
                    mask[..., :context][..., ~keep] = -torch.inf
                    o = self.model(input_ids=tok, position_ids=torch.tensor([[context + step]]),
                                   attention_mask=mask, use_cache=True, logits_to_keep=1,
                                   **{self.kw: self.cache})
                    tok = o.logits[0, -1].argmax().view(1, 1)
                self.cache.crop(-(self.cache.get_seq_length() - context))
                times.append(time.perf_counter() - t)
        return float(np.mean(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3,
                        help="reruns actually timed per round (their mean is extrapolated)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternated rounds (replay, then rerun); medians")
    parser.add_argument("--traces", default=None)
    args = parser.parse_args()
    if args.decode < 1 or args.runs < 1 or args.rounds < 1:
        parser.error("--decode, --runs and --rounds must be at least 1")
    import numba

    threads = numba.get_num_threads()
    # The synthetic store's stored outputs are random tensors, so the replay's output check
    # flags them; errors are measured against the float64 recomputation either way.
    warnings.filterwarnings("ignore", message=r".*stored outputs that differ", category=UserWarning)
    pols = policy_grid(["snapkv", "h2o"], ["topk", "poisson", "bernoulli"], [0.25, 0.5],
                       design_params={"poisson": {"mixture": 0.1}},
                       score_params={"snapkv": {"window_source": "question"}})
    pairs = sum(args.seeds if p.needs_seeds else 1 for p in pols)
    print(f"load average at start: {load_average()}", flush=True)
    try:
        rerun = Rerun(args.context, args.decode, threads)
    except (ImportError, FileNotFoundError) as exc:
        print(f"capture/SmolLM2 not available ({exc}); nothing to compare with")
        return
    replay_s, rerun_s, ratios = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        traces = Path(args.traces) if args.traces else None
        label = str(traces)
        if traces is None:
            traces = Path(tmp) / "synthetic"
            synthetic_smollm2_store(traces, args.context, args.decode)
            label = f"synthetic SmolLM2-shaped store ({args.context}+{args.decode} positions)"
        store = open_store(traces)
        seq = store.sequence_ids[:1]
        replay(store, pols[:2], seeds=2, layers=[0], sequences=seq, progress=False)  # warm
        rerun.seconds(1)  # warm
        for r in range(args.rounds):
            t = time.perf_counter()
            table = replay(store, pols, seeds=args.seeds, sequences=seq, progress=False)
            replay_s.append(time.perf_counter() - t)
            print(f"round {r + 1}: replay {replay_s[-1]:.2f} s [load {load_average()}]", flush=True)
            rerun_s.append(rerun.seconds(args.runs))
            ratios.append(rerun_s[-1] * pairs / replay_s[-1])
            print(f"round {r + 1}: rerun {rerun_s[-1]:.2f} s per configuration, "
                  f"ratio {ratios[-1]:.0f}x [load {load_average()}]", flush=True)
        n_pos = int(store[seq[0]].n_positions)
    per_run, t_replay = statistics.median(rerun_s), statistics.median(replay_s)
    print(f"traces: {label}; sequence of {n_pos} positions; threads {threads}")
    print(f"{len(pols)} policies, {args.seeds} seeds -> {pairs} (policy, seed) pairs "
          f"(deterministic policies once); medians of {args.rounds} alternated rounds")
    print(f"{'':<34} {'seconds':>10}")
    print(f"{'SmolLM2 prefill (shared, not charged)':<34} {rerun.prefill:>10.2f}")
    print(f"{'rerun, one configuration':<34} {per_run:>10.2f}   ({args.decode} decode steps)")
    print(f"{'rerun, all pairs (extrapolated)':<34} {per_run * pairs:>10.1f}")
    print(f"{'replay, all pairs, all 30 layers':<34} {t_replay:>10.1f}   "
          f"({table.num_rows} result rows)")
    print(f"replay speedup over rerun (median of the per-round ratios): "
          f"{statistics.median(ratios):.0f}x; load average at the end: {load_average()}")


if __name__ == "__main__":
    main()
