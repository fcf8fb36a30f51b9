"""``tracesim synth --positions N --out STORE``: write a synthetic trace store."""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["register", "run_synth"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``synth`` subcommand."""
    p = subparsers.add_parser(
        "synth", help="write a synthetic trace store (sinks, local window, heavy hitters, "
        "retrieval heads)",
        description="Write a synthetic trace store in the normal format, so validate, replay, "
        "sweep and report work on it. The generative model is documented in docs/synth.md; "
        "the same --seed gives a byte-identical store.",
        epilog="example:\n  tracesim synth --positions 131072 --layers 1 --out traces/synth-128k\n"
        "  tracesim replay traces/synth-128k --seeds 8 --out results/synth-128k")
    p.add_argument("--positions", type=int, required=True,
                   help="stored positions per sequence (prompt + decode steps)")
    p.add_argument("--out", required=True, help="store directory (new, empty, or a store of "
                   "the same model to resume)")
    p.add_argument("--shape", choices=("smollm2", "llama"), default="smollm2",
                   help="smollm2: 30 layers, 9 heads / 3 kv heads, d=64; "
                   "llama: 32 layers, 32 heads / 8 kv heads, d=128")
    p.add_argument("--layers", type=int, default=None, help="number of layers (default: the "
                   "shape's)")
    p.add_argument("--sequences", type=int, default=1, help="number of sequences (default 1)")
    p.add_argument("--decode", type=int, default=64, help="decode queries (default 64)")
    p.add_argument("--window", type=int, default=32, help="observation windows (default 32)")
    p.add_argument("--h2o-queries", type=int, default=256,
                   help="prefill queries (one per prompt stratum) the H2O statistic is "
                   "accumulated from (default 256; exact when >= the prompt length)")
    p.add_argument("--dtype", choices=("float16", "float32"), default="float16",
                   help="storage dtype of the tensors")
    p.add_argument("--no-o-proj", action="store_true", help="do not store o_proj weights")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the generative model (same seed, byte-identical store)")
    p.add_argument("--sliding-window", type=int, default=None, metavar="W",
                   help="make layers sliding-window layers of window W (the query at t attends "
                        "(t - W, t]); every --full-every-th layer stays full (Gemma 3 style); "
                        "default: every layer full")
    p.add_argument("--full-every", type=int, default=6, metavar="K",
                   help="with --sliding-window: every K-th layer is full (default 6)")
    p.add_argument("--softcap", type=float, default=None, metavar="C",
                   help="attention-logit soft-cap C: logits C*tanh(s/C) (Gemma 2 style); "
                        "default: no cap")
    p.add_argument("--sinks", action="store_true",
                   help="a learned sink logit per layer and query head (gpt-oss style)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run_synth)


def run_synth(args: argparse.Namespace) -> int:
    """Run ``synth``; 0 on success, 2 on a user error."""
    from tracesim.counts import SEED_VALUE, SYNTH_LAYERS, SYNTH_POSITIONS, SYNTH_SEQUENCES
    from tracesim.outpaths import check_output
    from tracesim.sizes import MEMORY_BYTES, WRITE_BYTES, check_estimate
    from tracesim.store import StoreError

    from .store import SynthConfig, synth_sizes, write_synthetic_store

    try:
        # every count bounded before SynthConfig sizes anything (1e12 positions would be a
        # 3.6 TiB position array)
        check_output(args.out)  # an empty --out would be the working directory
        SYNTH_POSITIONS.check(args.positions, "--positions")
        SYNTH_SEQUENCES.check(args.sequences, "--sequences")
        if args.layers is not None:
            SYNTH_LAYERS.check(args.layers, "--layers")
        for opt in ("decode", "window", "h2o_queries"):
            SYNTH_POSITIONS.check(getattr(args, opt), "--" + opt.replace("_", "-"))
        SEED_VALUE.check(args.seed, "--seed")  # like every seed; 1e30 overflowed a C long
        cfg = SynthConfig(positions=args.positions, shape=args.shape, layers=args.layers,
                          sequences=args.sequences, decode=args.decode, window=args.window,
                          h2o_queries=args.h2o_queries, dtype=args.dtype,
                          o_proj=not args.no_o_proj, seed=args.seed,
                          sliding_window=args.sliding_window, full_every=args.full_every,
                          softcap=args.softcap, sinks=args.sinks)
        # each count is within its bound; their product may not be (1M positions x 4096
        # layers x 10k sequences): estimated before anything is allocated
        memory, written = synth_sizes(cfg)
        what = (f"--positions {cfg.positions} x --layers {cfg.n_layers} x --sequences "
                f"{cfg.sequences} ({cfg.shape}, {cfg.dtype})")
        check_estimate(memory, MEMORY_BYTES, what, "memory")
        check_estimate(written, WRITE_BYTES, what, "store written")
    except ValueError as exc:
        print(f"tracesim synth: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {line}", file=sys.stderr)

    try:
        path = write_synthetic_store(args.out, cfg, None if args.quiet else progress)
    except StoreError as exc:
        print(f"tracesim synth: {exc}", file=sys.stderr)
        return 2
    m = cfg.model()
    print(f"wrote {path}: {cfg.sequences} sequence(s) x {cfg.positions} positions, "
          f"{m.n_layers} layers, {m.n_heads} heads / {m.n_kv_heads} kv heads, d={m.head_dim}, "
          f"{cfg.dtype} ({time.perf_counter() - start:.1f} s)")
    return 0
