"""``tracesim sweep SPEC --dry-run``: task count, estimated work and time, output layout."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np

from tracesim.sweep.spec import SweepSpec
from tracesim.sweep.tasks import TaskPlan, config_cost, plan_tasks, task_file_ok

__all__ = ["Calibration", "calibrate", "describe"]


class Calibration:
    """Measured replay rate on one real layer: work units per second (one worker)."""

    def __init__(self, rate: float, seconds: float, n_configs: int, where: str) -> None:
        self.rate, self.seconds, self.n_configs, self.where = rate, seconds, n_configs, where


def calibrate(spec: SweepSpec, plan: TaskPlan, threads: int,
              max_configs: int = 12) -> Calibration:
    """Time one layer of the median task with up to ``max_configs`` of its configurations.

    The JIT is warmed up first (not timed). Work is counted as in :func:`plan_tasks`. The
    caller's thread counts are restored afterwards.
    """
    from tracesim.sweep.worker import threads_limited

    with threads_limited(threads):
        return _calibrate(spec, plan, max_configs)


def _calibrate(spec: SweepSpec, plan: TaskPlan, max_configs: int) -> Calibration:
    from tracesim.replay import layer_batch, load_layer, replay_layer_runs
    from tracesim.store import open_store
    from tracesim.sweep.worker import warm_up

    warm_up()
    task = plan.tasks[len(plan.tasks) // 2]
    store = open_store(task.store_path)
    seq = store[task.sequence_id]
    a, b = task.configs
    idx = np.unique(np.linspace(a, b - 1, min(max_configs, b - a)).round().astype(int))
    policies = [spec.policies[i] for i in idx]
    m = store.model
    trace = load_layer(store, seq, task.layers[0])
    t0 = time.perf_counter()
    results = replay_layer_runs(trace, policies, np.asarray(spec.seeds), m.n_layers,
                                spec.options)
    for result in results:
        layer_batch(result, per_seed=spec.per_seed)
    seconds = time.perf_counter() - t0
    nq, P = results[0].query_positions.size, trace.n_positions
    work = sum(config_cost(p, len(spec.seeds), m.n_heads, m.n_kv_heads, nq, P,
                           trace.prompt_length, spec.per_seed)[0] for p in policies)
    work += m.n_heads * nq * P
    return Calibration(work / max(seconds, 1e-9), seconds, len(policies),
                       f"{task.store}/{task.sequence_id} layer {task.layers[0]}")


def _fmt_seconds(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def describe(spec: SweepSpec, *, workers: int | None = None, threads: int | None = None,
             calibrate_time: bool = True) -> str:
    """The dry-run report: what would run, how much work, how long, and where results go."""
    from tracesim.sweep.run import _threads, default_workers

    plan = plan_tasks(spec)
    out = spec.output
    done = sum(task_file_ok(out, t) for t in plan.tasks) if out is not None else 0
    n_workers = workers or default_workers(len(plan.tasks) - done or 1)
    n_threads = _threads(n_workers, threads)
    pol = spec.policies
    lines = [f"sweep {spec.name!r} (spec {spec.source}, result hash {plan.spec_hash[:12]})"]
    for ref in spec.stores:
        ts = [t for t in plan.tasks if t.store == ref.name]
        seqs = len({t.sequence_id for t in ts})
        lines.append(f"store {ref.name!r}: {ref.path} ({seqs} sequence(s) selected)")
    evicting = [p.row() for p in pol if p.score.evicts]
    by = {k: Counter(f"{r[k]:g}" if k == "budget" else str(r[k]) for r in evicting)
          for k in ("score", "design", "correction", "budget", "allocator", "schedule")}
    full = " (+ full cache)" if len(evicting) < len(pol) else ""
    lines.append(f"grid: {len(pol)} configuration(s){full}; " + "; ".join(
        f"{k}: " + ", ".join(f"{v}" for v in c) for k, c in by.items()))
    for s in spec.skipped:
        lines.append(f"  skipped: {s}")
    n_rand = sum(p.needs_seeds for p in pol)
    lines.append(f"seeds: {len(spec.seeds)} ({n_rand} seed-dependent configuration(s), "
                 f"{len(pol) - n_rand} replayed once); record: {spec.record}")
    layers = sorted({n for t in plan.tasks for n in t.layers})
    lines.append(f"layers: {len(layers)} ({layers[0]}..{layers[-1]}); layers per task: "
                 f"{spec.layers_per_task}")
    n_cfg_chunks = len({(t.store, t.sequence_id, t.layers) for t in plan.tasks})
    lines.append(f"tasks: {len(plan.tasks)} ({plan.n_sequences} sequence(s) x layer chunks x "
                 f"{len(plan.tasks) // max(1, n_cfg_chunks)} configuration chunk(s)); already "
                 f"finished: {done}; to run: {len(plan.tasks) - done}")
    rows = sum(t.rows for t in plan.tasks)
    mem = max(t.memory_mb for t in plan.tasks)
    per_seq = plan.n_layer_units // max(1, plan.n_sequences)
    lines.append(f"work: {plan.n_sequences} sequence(s) x {per_seq} layer(s) x {len(pol)} "
                 f"config(s) x {len(spec.seeds)} seed(s) x evaluated "
                 f"queries x heads x positions = {plan.n_query_evals:.3g} query-position "
                 f"evaluations ({plan.work:.3g} after replaying deterministic configurations "
                 f"once); largest task ~{mem:.0f} MB; {rows} result rows")
    if calibrate_time and plan.tasks:
        cal = calibrate(spec, plan, n_threads)
        todo = sum(t.work for t in plan.tasks if out is None or not task_file_ok(out, t))
        est = todo / cal.rate / n_workers
        lines.append(f"time: ~{_fmt_seconds(est)} on {n_workers} worker(s) x {n_threads} "
                     f"thread(s) (calibrated: {cal.rate:.3g} units/s from {cal.n_configs} "
                     f"configuration(s) on {cal.where}, {cal.seconds:.2f} s; excludes worker "
                     "start-up)")
    where = str(out) if out is not None else "OUT (give output: or --out)"
    lines += [f"output: {where}/",
              "  spec.yaml, spec.json, configs.json      the spec and expanded configurations",
              "  tasks/<store>/<sequence>/L<first>-<last>_c<a>-<b>_<key>.parquet   one per "
              f"task ({len(plan.tasks)})",
              f"  results/parts/part-NNNNN.parquet        one part per task: every row once "
              f"({rows} rows)",
              "  results/manifest.json                   rows and sha256 of every part, schema",
              "  results/summary.json                    counts, hashes, wall time"]
    return "\n".join(lines)
