"""In-process replay of a whole store against the torch baseline, output space off and on.

The end-to-end case of a user's replay: every layer of the store's sequences, read from disk,
one policy (default SnapKV + Poisson, Hájek, 25 % budget) x 32 seeds. Three runs alternate for
``--rounds`` rounds (medians, 1-minute load average beside every timing):

- ``off``: :func:`tracesim.replay.replay` with ``output_space=False`` (the torch baseline's
  math), loading included;
- ``on``: the same with the output-space certificate (the default). The store object is
  shared by the rounds, so only the first ``on`` round computes the ``o_proj`` Gram blocks and
  QR factors of the layers the warm-up did not touch (they are cached on the store, as in a
  sweep worker); the medians are of rounds that reuse them;
- ``torch``: :func:`benchmarks.torch_replay.torch_replay` on every layer (float64, same
  inclusion tables and uniforms, taken from the engine), loading included, inclusion tables not
  (they are the engine's own).

Usage: ``python benchmarks/bench_replay_store.py [STORE] [--seeds 32] [--rounds 3]``
(default store: ``data/sample-traces``).

Issue 31's one configuration, self-contained (a synthetic SmolLM2-shaped store of 30 layers and
1,024 positions with 7 decode queries is written to a temporary directory first, untimed):
``python benchmarks/bench_replay_store.py --synth 1024 --decode 7 --rounds 5``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", nargs="?", default=str(ROOT / "data" / "sample-traces"))
    ap.add_argument("--score", default="snapkv")
    ap.add_argument("--design", default="poisson")
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--seeds", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sequences", type=int, default=1, help="first N sequences")
    ap.add_argument("--synth", type=int, default=0, metavar="POSITIONS",
                    help="replay a synthetic SmolLM2-shaped store of this many positions "
                         "(written to a temporary directory first) instead of STORE")
    ap.add_argument("--decode", type=int, default=7, help="decode queries of --synth")
    args = ap.parse_args(argv)
    if args.synth:
        import tempfile

        from tracesim.synth.store import SynthConfig, write_synthetic_store

        tmp = tempfile.TemporaryDirectory(prefix="bench-store-")
        args.store = str(write_synthetic_store(
            Path(tmp.name) / "store", SynthConfig(positions=args.synth, decode=args.decode)))
    import numba
    import torch

    from benchmarks.torch_replay import torch_replay
    from tracesim.policies import make_policy
    from tracesim.replay import ReplayOptions, load_layer, replay, replay_layer
    from tracesim.replay.inclusion import seed_uniforms
    from tracesim.store import open_store

    torch.set_num_threads(numba.get_num_threads())
    store = open_store(args.store)
    sids = list(store.sequence_ids)[:args.sequences]
    pols = [make_policy(args.score, args.design, args.budget, correction="hajek")]
    n_layers = store.model.n_layers
    replay(store, pols, seeds=2, layers=[0], sequences=sids[:1], progress=False)  # JIT

    def run_torch() -> None:
        seeds = np.arange(args.seeds)
        for sid in sids:
            seq = store[sid]
            for layer in range(n_layers):
                trace = load_layer(store, seq, layer)
                tabs = replay_layer(trace, pols, seeds[:1], n_layers,
                                    ReplayOptions(output_space=False)).tables
                # Seed-independent policy: the tables hold one slot; iterate every seed.
                tabs.it_cfg = np.zeros(args.seeds, np.int64)
                tabs.it_seed = np.arange(args.seeds, dtype=np.int64)
                tabs.it_slot = np.zeros(args.seeds, np.int64)
                tabs.it_kslot = np.full(args.seeds, -1, np.int64)
                u = seed_uniforms(seeds, layer, trace.n_kv_heads, trace.n_positions)
                t0, c0 = time.perf_counter(), time.process_time()
                torch_replay(trace, pols, tabs, u)
                timings["torch_math"] += time.perf_counter() - t0
                timings["torch_cpu"] += time.process_time() - c0

    times: dict[str, list[float]] = {"off": [], "on": [], "torch": []}
    cpu: dict[str, list[float]] = {"off": [], "on": [], "torch": []}
    print(f"store {args.store}: {len(sids)} sequence(s) x {n_layers} layers; {pols[0].id} x "
          f"{args.seeds} seeds; numba threads {numba.get_num_threads()}; load "
          f"{os.getloadavg()}", flush=True)
    for r in range(args.rounds):
        for name, on in (("off", False), ("on", True)):
            t, c = time.perf_counter(), time.process_time()
            replay(store, pols, seeds=args.seeds, sequences=sids, progress=False,
                   options=ReplayOptions(output_space=on))
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
            print(f"  round {r}: numba {name:3s} {times[name][-1]:6.2f} s (CPU "
                  f"{cpu[name][-1]:.2f} s) [load {os.getloadavg()[0]:.1f}]", flush=True)
        timings = {"torch_math": 0.0, "torch_cpu": 0.0}
        run_torch()
        times["torch"].append(timings["torch_math"])
        cpu["torch"].append(timings["torch_cpu"])
        print(f"  round {r}: torch     {times['torch'][-1]:6.2f} s (math only; CPU "
              f"{cpu['torch'][-1]:.2f} s) "
              f"[load {os.getloadavg()[0]:.1f}]", flush=True)
    med = {k: float(np.median(v)) for k, v in times.items()}
    mcpu = {k: float(np.median(v)) for k, v in cpu.items()}
    print(f"medians of {args.rounds}: off {med['off']:.2f} s, on {med['on']:.2f} s, torch "
          f"{med['torch']:.2f} s -> torch/off {med['torch'] / med['off']:.2f}x, on/off "
          f"{med['on'] / med['off']:.2f}x (CPU: torch/off {mcpu['torch'] / mcpu['off']:.2f}x, "
          f"on/off {mcpu['on'] / mcpu['off']:.2f}x); load "
          f"at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
