"""Peak memory of a replay vs the size of the trace store it reads.

Writes a synthetic store (one long sequence, many layers), replays a few policies over every
layer while a thread samples the process's resident memory, and prints the peak growth of
anonymous memory (the replay's working set) next to the store size. Memory-mapped store pages
count as file-backed RSS (page cache the kernel can drop); they are reported separately.

Usage: ``python benchmarks/bench_memory.py [--layers 48 --positions 4096 --json]``
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np


def _rss() -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes of this process (Linux /proc)."""
    anon = file = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            anon = int(line.split()[1]) * 1024
        elif line.startswith("RssFile:"):
            file = int(line.split()[1]) * 1024
    return anon, file


def write_store(path: Path, n_layers: int, P: int, n_heads: int = 4, n_kv: int = 2,
                d: int = 64, n_decode: int = 32) -> int:
    """A valid store with random tensors; returns its size in bytes."""
    from tracesim.store import ModelMeta, TraceWriter

    pl = P - n_decode
    qpos = list(range(pl - 16, pl)) + list(range(pl, P))
    roles = ["question_window"] * 16 + ["decode"] * n_decode
    model = ModelMeta(model_id="bench", architecture="LlamaForCausalLM", n_layers=n_layers,
                      n_heads=n_heads, n_kv_heads=n_kv, head_dim=d, hidden_size=n_heads * d,
                      scaling=d**-0.5, dtype="float32")
    rng = np.random.default_rng(0)
    h2o = np.zeros((n_heads, P), np.float32)
    h2o[:, :pl] = 1.0
    with TraceWriter(path, model) as writer:
        row = dict(task="bench", seed=0, length=P, token_ids=np.zeros(P, np.int32),
                   prompt_length=pl, context_start=0, context_end=pl - 32,
                   question_start=pl - 32, question_end=pl, generated_ids=[1] * (n_decode + 1),
                   generated_logprobs=np.zeros(n_decode + 1, np.float32), answer="",
                   gold="", correct=True, query_positions=qpos, query_roles=roles)
        with writer.sequence("long", **row) as sw:
            for layer in range(n_layers):
                sw.add_layer(layer,
                             keys=rng.standard_normal((n_kv, P, d), np.float32),
                             values=rng.standard_normal((n_kv, P, d), np.float32),
                             queries=rng.standard_normal((n_heads, len(qpos), d), np.float32),
                             outputs=rng.standard_normal((n_heads, len(qpos), d), np.float32),
                             h2o=h2o)
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(n_layers: int = 48, P: int = 4096, seeds: int = 4) -> dict:
    """Replay every layer and return sizes in MB."""
    from tracesim.policies import make_policy
    from tracesim.replay import iter_replay, replay
    from tracesim.store import open_store

    with tempfile.TemporaryDirectory() as tmp:
        store_bytes = write_store(Path(tmp) / "store", n_layers, P)
        store = open_store(Path(tmp) / "store")
        # The store records 16 question-window queries (SnapKV's default window reads 32).
        sp = {"window_source": "question"}
        pols = [make_policy("snapkv", "topk", 0.25, score_params=sp),
                make_policy("snapkv", "poisson", 0.25, score_params=sp)]
        replay(store, pols, seeds=seeds, layers=[0], progress=False)  # compile / load cache
        gc.collect()
        base_anon, base_file = _rss()
        peak = [base_anon, base_file]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                a, f = _rss()
                peak[0], peak[1] = max(peak[0], a), max(peak[1], f)
                time.sleep(0.002)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        t0 = time.perf_counter()
        # Batches are consumed as they come (as the CLI streams them to Parquet), so the
        # growth measured is the engine's working set, not the accumulated results.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the random outputs fail the output check
            rows = sum(b.num_rows for b in iter_replay(store, pols, seeds=seeds,
                                                       progress=False))
        elapsed = time.perf_counter() - t0
        done.set()
        thread.join()
    mb = 1 / 2**20
    return {"store_mb": store_bytes * mb, "layers": n_layers, "positions": P,
            "layer_mb": store_bytes * mb / n_layers, "rows": rows,
            "anon_growth_mb": (peak[0] - base_anon) * mb, "anon_peak_mb": peak[0] * mb,
            "file_growth_mb": (peak[1] - base_file) * mb, "seconds": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--positions", type=int, default=4096)
    parser.add_argument("--json", action="store_true", help="print one JSON line only")
    args = parser.parse_args()
    r = measure(args.layers, args.positions)
    if args.json:
        print(json.dumps(r))
        return
    print(f"store: {r['store_mb']:.1f} MB ({r['layers']} layers x {r['layer_mb']:.1f} MB, "
          f"{r['positions']} positions)")
    print(f"replay working set (peak anonymous RSS growth): {r['anon_growth_mb']:.1f} MB "
          f"= {r['anon_growth_mb'] / r['store_mb']:.2f} x store "
          f"({r['store_mb'] / max(r['anon_growth_mb'], 1e-9):.1f}x smaller)")
    print(f"file-backed RSS growth (memory-mapped store pages, reclaimable): "
          f"{r['file_growth_mb']:.1f} MB; replay time {r['seconds']:.1f} s")


if __name__ == "__main__":
    main()
