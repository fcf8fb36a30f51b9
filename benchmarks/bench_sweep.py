"""Sweep scaling: 2 workers vs 1 on a >= 200-configuration sweep, and per-task backend overhead.

Side by side in one run, on ``data/sample-traces`` when it exists (else a synthetic store of
the same shape: 3 sequences x 30 layers, 9 heads / 3 KV heads, d = 64, ~128 positions):

A. a whole sweep of 217 configurations (6 scores x {topk, poisson, bernoulli} x budgets
   {0.25, 0.5, 48 tokens} x {uniform, adakv} x {oneshot, decode:4}, + full) x 16 seeds over every
   layer and sequence (90 tasks), end to end (worker start-up, JIT warm-up, compaction
   included) on ``local`` with 1 worker, ``local`` with 2 workers and ``dask`` with 2 workers,
   at the default of one numba thread per worker (one worker = one core), alternated for
   ``--rounds`` rounds (medians, load printed beside every run); results checked identical;
B. per-task overhead on many tiny tasks (1 configuration, 1 seed, 90 tasks): the steady-state
   cost per task (``workers x`` the interval between task completions, start-up excluded)
   minus the in-process time of the same tasks, for ``local`` and ``dask`` with 2 workers
   (median of 3 runs each).

Usage: ``python benchmarks/bench_sweep.py [--seeds 16] [--json]`` (~2.5 min on 2 idle cores)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tracesim.sweep import parse_spec, plan_tasks, run_sweep  # noqa: E402
from tracesim.sweep.backends import Events, run_dask, run_local  # noqa: E402
from tracesim.sweep.worker import execute_task, warm_up, write_configs  # noqa: E402

SAMPLE = ROOT / "data" / "sample-traces"


def synthetic_store(path: Path, n_seqs: int = 3, n_layers: int = 30, P: int = 128) -> Path:
    """A SmolLM2-shaped float16 store with exact full-cache outputs and H2O sums."""
    from tracesim.store import ModelMeta, TraceWriter

    H, n_kv, d = 9, 3, 64
    model = ModelMeta(model_id="synthetic-smollm2", architecture="LlamaForCausalLM",
                      n_layers=n_layers, n_heads=H, n_kv_heads=n_kv, head_dim=d,
                      hidden_size=576, scaling=d**-0.5, dtype="float16")
    rng = np.random.default_rng(0)
    with TraceWriter(path, model) as writer:
        for s in range(n_seqs):
            pl, qs = P - 8, P - 24
            qpos = np.r_[qs - 8:qs, pl - 8:pl, pl:P]
            roles = ["context_window"] * 8 + ["question_window"] * 8 + ["decode"] * 8
            row = dict(task="synthetic", seed=s, length=P, token_ids=np.zeros(P, np.int32),
                       prompt_length=pl, context_start=0, context_end=qs, question_start=qs,
                       question_end=pl, generated_ids=[1] * 9,
                       generated_logprobs=np.zeros(9, np.float32), answer="", gold="",
                       correct=True, query_positions=qpos.tolist(), query_roles=roles)
            with writer.sequence(f"syn{s}", **row) as sw:
                for layer in range(n_layers):
                    k = rng.standard_normal((n_kv, P, d)).astype(np.float16)
                    v = rng.standard_normal((n_kv, P, d)).astype(np.float16)
                    q = rng.standard_normal((H, P, d)).astype(np.float16)
                    sc = np.einsum("hqd,hpd->hqp", q.astype(np.float64),
                                   np.repeat(k, H // n_kv, axis=0).astype(np.float64)) * d**-0.5
                    sc[:, np.arange(P)[None, :] > np.arange(P)[:, None]] = -np.inf
                    w = np.exp(sc - sc.max(axis=2, keepdims=True))
                    w /= w.sum(axis=2, keepdims=True)
                    o = np.einsum("hqp,hpd->hqd", w, np.repeat(v, H // n_kv, axis=0)
                                  .astype(np.float64))
                    sw.add_layer(layer, keys=k, values=v, queries=q[:, qpos],
                                 outputs=o[:, qpos].astype(np.float16),
                                 h2o=w[:, :pl].sum(axis=1).astype(np.float32))
    return path


def big_spec(store: Path, seeds: int) -> dict:
    return {"name": "bench-big", "store": str(store), "seeds": seeds,
            "grid": {"score": ["snapkv", "h2o", "tova", "knorm", "vnorm", "streaming", "full"],
                     "design": ["topk", "poisson", "bernoulli"], "budget": [0.25, 0.5, 48],
                     "allocator": ["uniform", "adakv"], "schedule": ["oneshot", "decode:4"],
                     "score_params": {"*": {"window": 8}}}}


def tiny_spec(store: Path) -> dict:
    return {"name": "bench-tiny", "store": str(store), "seeds": 1,
            "grid": {"score": "streaming", "design": "topk", "budget": 0.5,
                     "score_params": {"streaming": {"window": 8}}}}


def sorted_results(out: Path):
    import pandas as pd

    df = pd.read_parquet(out / "results" / "parts")
    keys = ["store", "sequence_id", "layer", "config_id", "head", "query_index", "seed"]
    return df.sort_values(keys).reset_index(drop=True)


def whole_sweeps(store: Path, seeds: int, tmp: Path, rounds: int = 3) -> dict:
    """Alternate local x1, local x2, dask x2 for ``rounds`` rounds (default thread count:
    one per worker); medians of the wall times, load printed beside every run."""
    runs: dict[str, dict] = {}
    for r in range(rounds):
        for label, backend, workers in (("local x1", "local", 1), ("local x2", "local", 2),
                                        ("dask x2", "dask", 2)):
            out = tmp / f"{label.replace(' ', '')}-{r}"
            summary = run_sweep(big_spec(store, seeds), backend=backend, workers=workers,
                                out=out, progress=False)
            if not summary.complete:
                raise RuntimeError(f"{label}: sweep incomplete: {summary.failures[:2]}")
            busy = summary.task_time_s
            run = runs.setdefault(label, {"wall_s_all": [], "task_wall_s": [],
                                          "task_cpu_s": [], "load": []})
            run["wall_s_all"].append(summary.wall_time_s)
            run["task_wall_s"].append(busy["wall"])
            run["task_cpu_s"].append(busy["cpu"])
            run["load"].append(os.getloadavg()[0])
            run.update(tasks=summary.tasks["done"], configs=summary.n_configs,
                       rows=summary.n_rows, threads=summary.threads_per_worker)
            print(f"  round {r} {label:9s} {summary.wall_time_s:7.1f} s  ({summary.tasks['done']}"
                  f" tasks x {summary.threads_per_worker} thread(s), {summary.n_configs} configs"
                  f" x {seeds} seeds, {summary.n_rows} rows; tasks: {busy['wall']:.1f} s wall, "
                  f"{busy['cpu']:.1f} s CPU) [load {os.getloadavg()[0]:.1f}]", flush=True)
            if r == 0 and label != "local x1":
                if not sorted_results(tmp / "localx1-0").equals(sorted_results(out)):
                    raise AssertionError(f"{label} results differ from local x1")
    for run in runs.values():
        run["wall_s"] = float(np.median(run["wall_s_all"]))
    return runs


def tiny_tasks(store: Path, tmp: Path, repeats: int = 3) -> dict:
    spec = load_spec_dict(tiny_spec(store), tmp / "tiny-inproc")
    plan = plan_tasks(spec)
    write_configs(spec.output, plan, spec)
    warm_up()
    t0 = time.perf_counter()
    for task in plan.tasks:
        execute_task(task, str(spec.output), plan.spec_hash, 1)
    inproc = (time.perf_counter() - t0) / len(plan.tasks)
    out = {"tasks": len(plan.tasks), "in_process_s": inproc}
    for label, runner in (("local", run_local), ("dask", run_dask)):
        starts, costs = [], []
        for rep in range(repeats):
            spec = load_spec_dict(tiny_spec(store), tmp / f"tiny-{label}-{rep}")
            write_configs(spec.output, plan, spec)
            stamps: list[float] = []
            start = time.perf_counter()
            events = Events(done=lambda t, i, s=stamps: s.append(time.perf_counter()),
                            retry=lambda t, e: None, failed=lambda t, e: print("failed", e))
            runner(plan.tasks, str(spec.output), plan.spec_hash, events, workers=2, threads=1)
            stamps.sort()
            starts.append(stamps[0] - start)
            costs.append(2 * (stamps[-1] - stamps[0]) / (len(stamps) - 1))
        per_task, start_s = float(np.median(costs)), float(np.median(starts))
        out[label] = {"start_s": start_s, "per_task_s": per_task, "overhead_s": per_task - inproc,
                      "per_task_all_s": costs}
        print(f"  {label:6s} start-up to first task {start_s:5.1f} s; per task "
              f"{per_task * 1e3:6.1f} ms (in-process {inproc * 1e3:5.1f} ms) -> overhead "
              f"{(per_task - inproc) * 1e3:6.1f} ms/task (median of {repeats}: "
              + ", ".join(f"{1e3 * (c - inproc):.1f}" for c in costs) + ")", flush=True)
    return out


def load_spec_dict(doc: dict, out: Path):
    return parse_spec(doc, output=out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (medians)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        store = SAMPLE if (SAMPLE / "manifest.parquet").is_file() else synthetic_store(
            tmp / "store")
        load0 = os.getloadavg()
        print(f"store: {store} ; cores: {os.cpu_count()} ; load average before: "
              f"{load0[0]:.2f}", flush=True)
        print("A. whole sweep, end to end:", flush=True)
        runs = whole_sweeps(store, args.seeds, tmp, args.rounds)
        speedup = runs["local x1"]["wall_s"] / runs["local x2"]["wall_s"]
        dask_speedup = runs["local x1"]["wall_s"] / runs["dask x2"]["wall_s"]
        print(f"  speed-up 2 workers vs 1 (medians of {args.rounds}): local {speedup:.2f}x, "
              f"dask {dask_speedup:.2f}x (results identical)", flush=True)
        print("B. per-task overhead on tiny tasks (2 workers):", flush=True)
        tiny = tiny_tasks(store, tmp)
        load1 = os.getloadavg()
        print(f"load average after: {load1[0]:.2f}")
        if args.json:
            print(json.dumps({"store": str(store), "runs": runs, "speedup_local": speedup,
                              "speedup_dask": dask_speedup, "tiny": tiny,
                              "load": [load0[0], load1[0]]}, indent=1))


if __name__ == "__main__":
    main()
