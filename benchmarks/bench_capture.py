"""Capture overhead and trace size.

For the same prompts, side by side in one run (interleaved, best of ``--repeats``):

- ``plain``: greedy generation with transformers' SDPA attention, nothing recorded;
- ``hook idle``: the capture attention function registered but no state attached (its mask path);
- ``record``: generation with recording (K/V, windows, decode queries, chunked H2O) + finalize;
- ``write``: writing the recorded sequence into a trace store (fp16 and fp32).

Bytes per token is the tensor file size divided by the number of stored positions.

Usage::

    python benchmarks/bench_capture.py [--model smollm2] [--lengths 512,1024] [--repeats 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from tracesim.capture.attention import CAPTURE_ATTN
from tracesim.capture.generate import greedy_generate
from tracesim.capture.models import load_model, o_proj_weights, set_attention
from tracesim.capture.runner import CaptureConfig, capture_prompt, eos_token_ids, model_meta
from tracesim.capture.tasks import build_prompt, instance_seed

from tracesim.store import TraceWriter


def _time(fn, *args) -> tuple[tuple[float, float], object]:
    """(wall seconds, process CPU seconds) and the result; CPU time is less sensitive to other
    processes competing for the cores, wall time is what a user waits."""
    t0, c0 = time.perf_counter(), time.process_time()
    result = fn(*args)
    return (time.perf_counter() - t0, time.process_time() - c0), result


def _write(loaded, row, layers, dtype: str, root: Path, name: str) -> tuple[float, int]:
    store = root / f"{name}-{dtype}"
    with TraceWriter(store, model_meta(loaded, dtype), o_proj=None) as writer:
        t0 = time.perf_counter()
        with writer.sequence(name, **row) as sw:
            for layer, a in enumerate(layers):
                sw.add_layer(layer, keys=a.keys, values=a.values, queries=a.queries,
                             outputs=a.outputs, h2o=a.h2o)
        seconds = time.perf_counter() - t0
    n_bytes = sum(p.stat().st_size for p in (store / "seq").iterdir())
    return seconds, n_bytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--task", default="passkey")
    ap.add_argument("--lengths", default="512,1024")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(args.model, args.device)
    model = loaded.model
    eos = eos_token_ids(loaded)
    budget = args.max_new_tokens
    cfg = CaptureConfig(max_new_tokens=budget)
    o_proj_bytes = o_proj_weights(model).nbytes
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for length in [int(x) for x in args.lengths.split(",")]:
            prompt = build_prompt(loaded.tokenizer, args.task, length,
                                  instance_seed(args.task, length, 0, 0))
            times: dict[str, list[tuple[float, float]]] = {"plain": [], "idle": [], "record": []}
            for _ in range(args.repeats):
                # Interleaved so that load from other processes hits all variants alike.
                set_attention(model, "sdpa")
                t, plain = _time(greedy_generate, model, prompt.token_ids, budget, eos)
                times["plain"].append(t)
                set_attention(model, CAPTURE_ATTN)
                t, _ = _time(greedy_generate, model, prompt.token_ids, budget, eos)
                times["idle"].append(t)
                t, (row, layers) = _time(capture_prompt, loaded, prompt, cfg)
                times["record"].append(t)
                assert row["generated_ids"] == plain.generated_ids
            w16, b16 = _write(loaded, row, layers, "float16", Path(tmp), f"L{length}")
            w32, b32 = _write(loaded, row, layers, "float32", Path(tmp), f"L{length}")
            best = {k: min(w for w, _ in v) for k, v in times.items()}
            cpu = {k: min(c for _, c in v) for k, v in times.items()}
            rows.append(dict(
                length=prompt.prompt_length, n_pos=row["n_positions"], n_query=row["n_query"],
                plain=best["plain"], idle=best["idle"], record=best["record"],
                cpu_ratio=cpu["record"] / cpu["plain"],
                w16=w16, w32=w32, bpt16=b16 / row["n_positions"], bpt32=b32 / row["n_positions"],
            ))

    print(f"model {loaded.model_id} on {args.device} ({torch.get_num_threads()} threads), "
          f"{args.task}, {args.max_new_tokens} new tokens, best of {args.repeats}")
    print(f"{'prompt':>6} {'stored':>6} {'queries':>7} {'plain s':>8} {'idle s':>7} "
          f"{'record s':>8} {'idle/plain':>10} {'record/plain':>12} {'(cpu)':>6} "
          f"{'write16 s':>9} {'write32 s':>9} {'B/tok fp16':>10} {'B/tok fp32':>10}")
    for r in rows:
        print(f"{r['length']:>6} {r['n_pos']:>6} {r['n_query']:>7} {r['plain']:>8.2f} "
              f"{r['idle']:>7.2f} {r['record']:>8.2f} {r['idle'] / r['plain']:>10.2f} "
              f"{r['record'] / r['plain']:>12.2f} {r['cpu_ratio']:>6.2f} {r['w16']:>9.2f} "
              f"{r['w32']:>9.2f} {r['bpt16']:>10.0f} {r['bpt32']:>10.0f}")
    print("ratios are wall-clock (best of the repeats); (cpu) is record/plain in process CPU time")
    print(f"o_proj (stored once per store, float32): {o_proj_bytes / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
