"""What runs on a worker process: thread limits, JIT warm-up, and executing one task.

Workers read the sweep's configurations from ``OUT/configs.json`` (written by the driver before
any task is submitted; parsed once per worker and spec) and the trace stores from their paths,
so tasks stay tiny and the output directory and stores must be on a filesystem every worker sees.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from tracesim.atomic import atomic_output, atomic_write_bytes
from tracesim.sweep.spec import code_fingerprint

__all__ = ["LOADED_CODE", "configure_threads", "execute_task", "init_worker", "threads_limited",
           "warm_up", "write_configs"]

#: Fingerprint of tracesim's source as this process imported it (forkserver children inherit
#: the server's): tasks refuse to run when the driver planned with different code.
LOADED_CODE: str = code_fingerprint()

_STORES: dict[str, Any] = {}
_CONFIGS: dict[tuple[str, str], tuple[list, np.ndarray, bool, Any]] = {}
_WARM: list[float] = []


def configure_threads(threads: int) -> int:
    """Limit numba (for the calling thread) and BLAS/OpenMP (process-wide) to ``threads``.

    numba's setting is thread-local, so this runs at the start of every task (cheap).
    Returns the numba thread count actually used (capped by ``NUMBA_NUM_THREADS``).
    """
    import numba
    from threadpoolctl import threadpool_limits

    t = max(1, min(int(threads), int(numba.config.NUMBA_NUM_THREADS)))
    numba.set_num_threads(t)
    threadpool_limits(limits=t)
    return t


@contextlib.contextmanager
def threads_limited(threads: int):
    """:func:`configure_threads` for a block of work in the caller's own process, restoring
    numba's and BLAS/OpenMP's thread counts afterwards (an in-process calibration must not
    leave a notebook or a test session single-threaded)."""
    import numba
    from threadpoolctl import threadpool_limits

    before = numba.get_num_threads()
    with threadpool_limits(limits=max(1, int(threads))):
        try:
            yield configure_threads(threads)
        finally:
            numba.set_num_threads(before)


def _synthetic_trace(seed: int = 0):
    """A tiny float64 layer (2 heads, 1 KV head, d=8, 64 positions, 8 decode queries)."""
    from tracesim.layer_trace import LayerTrace

    rng = np.random.default_rng(seed)
    H, d, P, prompt = 2, 8, 64, 56
    keys = rng.standard_normal((1, P, d))
    values = rng.standard_normal((1, P, d))
    q_all = rng.standard_normal((H, P, d))
    s = np.einsum("hqd,pd->hqp", q_all, keys[0]) * d**-0.5
    s[:, np.arange(P)[None, :] > np.arange(P)[:, None]] = -np.inf
    w = np.exp(s - s.max(axis=2, keepdims=True))
    w /= w.sum(axis=2, keepdims=True)
    qpos = np.concatenate([np.arange(40, 48), np.arange(prompt - 8, prompt),
                           np.arange(prompt, P)])
    roles = ["context_window"] * 8 + ["question_window"] * 8 + ["decode"] * (P - prompt)
    return LayerTrace(layer=0, keys=keys, values=values, queries=q_all[:, qpos],
                      outputs=np.einsum("hqp,pd->hqd", w, values[0])[:, qpos],
                      h2o=w[:, :prompt].sum(axis=1), query_positions=qpos,
                      query_roles=roles, prompt_length=prompt, question_start=48,
                      scale=d**-0.5, o_proj=rng.standard_normal((4, H * d)),
                      sequence_id="warm-up", meta={"task": "warm-up", "correct": True})


def warm_up() -> float:
    """Compile (or load from numba's cache) every kernel the replay uses; once per process.

    Replays every score × design on a tiny synthetic layer, plus the decode and per-step
    schedules and the Ada-KV / PyramidKV allocators. Returns the seconds spent (0 when
    already warm).
    """
    if _WARM:
        return 0.0
    from tracesim.budgets import Budget
    from tracesim.policies import SCORES, make_policy, policy_grid
    from tracesim.policies.kvpress import KVPRESS_PRESSES
    from tracesim.replay import layer_batch, replay_layer

    t0 = time.perf_counter()
    # The kvpress presses share their base scores' kernels (and ExpectedAttentionPress needs
    # RoPE settings this layer does not have).
    event_scores = sorted(s for s, cls in SCORES.items()
                          if not cls.per_step and s not in KVPRESS_PRESSES)
    small = {s: {"window": 4} for s in event_scores if s != "full"}
    policies = policy_grid(event_scores, ["topk", "poisson", "bernoulli", "fixed"], [0.5],
                           score_params=small)
    policies += [make_policy("h2o", d, 0.5, schedule="decode:4", score_params={"window": 4})
                 for d in ("topk", "poisson")]
    policies += [make_policy("perstep", "poisson", 0.5, schedule=s, score_params={"window": 4})
                 for s in ("step", "step:permanent")]
    policies += [make_policy("snapkv", "poisson", Budget(0.5, allocator=a),
                             score_params={"window": 4}) for a in ("adakv", "pyramidkv")]
    result = replay_layer(_synthetic_trace(), policies, np.arange(2), 2)
    layer_batch(result, per_seed=True)
    layer_batch(result, per_seed=False)
    _WARM.append(time.perf_counter() - t0)
    return _WARM[0]


def init_worker(threads: int, warm: bool = True, driver: tuple[int, str | None] | None = None
                ) -> None:
    """Process-pool initializer: exit with the driver (``driver`` = its pid and start time,
    :func:`tracesim.orphans.watch_driver`), thread limits, then the JIT warm-up."""
    from tracesim.orphans import watch_driver

    if driver is not None:
        watch_driver(*driver)
    configure_threads(threads)
    if warm:
        warm_up()


def write_configs(out_dir: Path, plan: Any, spec: Any) -> Path:
    """Write ``OUT/configs.json`` atomically (what workers replay); return its path.

    Parameters
    ----------
    out_dir : Path
    plan : tracesim.sweep.tasks.TaskPlan
        Gives the result hash and the source fingerprint workers must match.
    spec : tracesim.sweep.spec.SweepSpec
    """
    from tracesim.policies import Policy

    configs = []
    for p in spec.policies:
        doc = json.loads(p.to_json())
        if Policy.from_dict(doc).id != p.id:
            raise ValueError(f"policy {p.id!r} does not survive its JSON round trip")
        configs.append({"id": p.id, **doc})
    from tracesim.plugins import in_process_only, plugin_provenance

    plugins = plugin_provenance(spec.policies)
    local = in_process_only(plugins)
    if local:
        raise ValueError(f"plugin(s) {local} are registered in this process only (decorator); "
                         "sweep workers are other processes: declare them as entry points of an "
                         "installed distribution (docs/extending.md)")
    opts = spec.options
    doc = {"spec_hash": plan.spec_hash, "code": plan.code, "plugins": plugins,
           "seeds": list(spec.seeds),
           "record": spec.record,
           "options": {"alpha": opts.alpha, "output_space": opts.output_space,
                       "satterthwaite": opts.satterthwaite, "precision": opts.precision,
                       "roles": None if opts.roles is None else list(opts.roles)},
           "configs": configs}
    if opts.bootstrap:  # absent when off: the file of a sweep without it is unchanged
        doc["options"]["bootstrap"] = opts.bootstrap
    path = Path(out_dir) / "configs.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps(doc, indent=1).encode(), unique=True)
    return path


def _configs(out_dir: str, spec_hash: str):
    key = (out_dir, spec_hash)
    if key not in _CONFIGS:
        from tracesim.policies import Policy
        from tracesim.replay import ReplayOptions
        from tracesim.safeio import read_json

        doc = read_json(Path(out_dir) / "configs.json", "sweep configs")
        if doc["spec_hash"] != spec_hash:
            raise RuntimeError(f"{out_dir}/configs.json belongs to spec {doc['spec_hash'][:12]}"
                               f", not {spec_hash[:12]}: another sweep uses this directory")
        if doc["code"] != LOADED_CODE:
            raise RuntimeError("this worker runs different tracesim source code than the "
                               "driver (code fingerprint mismatch); install the same version "
                               "on every worker")
        policies = [Policy.from_dict({k: v for k, v in c.items() if k != "id"})
                    for c in doc["configs"]]
        _check_plugins(policies, doc.get("plugins", []))
        o = doc["options"]
        options = ReplayOptions(alpha=o["alpha"], output_space=o["output_space"],
                                satterthwaite=o["satterthwaite"],
                                precision=o.get("precision", "float64"),
                                bootstrap=o.get("bootstrap", 0),
                                roles=None if o["roles"] is None else tuple(o["roles"]))
        _CONFIGS[key] = (policies, np.asarray(doc["seeds"], dtype=np.int64),
                         doc["record"] == "per_seed", options)
    return _CONFIGS[key]


def _check_plugins(policies: list, expected: list[dict[str, str]]) -> None:
    """Refuse to run when this worker's plugins differ from the driver's (name, version,
    source hash)."""
    from tracesim.plugins import plugin_provenance

    mine = plugin_provenance(policies, as_loaded=True)
    if mine != expected:
        diff = [f"{e.get('name')}: driver {e.get('distribution')} {e.get('version')} "
                f"{str(e.get('source_hash'))[:19]}, worker {m.get('distribution')} "
                f"{m.get('version')} {str(m.get('source_hash'))[:19]}"
                for e, m in zip(expected, mine, strict=False) if e != m]
        raise RuntimeError("this worker loads different plugin code than the driver "
                           f"({'; '.join(diff) or 'different plugin set'}); install the same "
                           "plugin version on every worker")


def _store(path: str):
    if path not in _STORES:
        from tracesim.store import open_store

        _STORES[path] = open_store(path)
    return _STORES[path]


def execute_task(task: Any, out_dir: str, spec_hash: str, threads: int) -> dict[str, Any]:
    """Replay one task and write its Parquet file atomically (temp + fsync + rename).

    Parameters
    ----------
    task : tracesim.sweep.tasks.Task
    out_dir : str
        The sweep's output directory (holding ``configs.json``).
    spec_hash : str
        Result hash of the spec the task belongs to (checked against ``configs.json``).
    threads : int
        numba / BLAS threads for this task.

    Returns
    -------
    dict
        ``key``, ``rows``, ``seconds`` (wall), ``cpu_s`` (process CPU), ``pid``.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tracesim.replay import iter_replay
    from tracesim.sweep.tasks import META_KEY, sweep_schema

    t0, c0 = time.perf_counter(), time.process_time()
    configure_threads(threads)
    warm_up()
    policies, seeds, per_seed, options = _configs(out_dir, spec_hash)
    store = _store(task.store_path)
    path = Path(out_dir) / task.path
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"key": task.key, "spec_hash": spec_hash, "run_id": spec_hash, "rows": task.rows,
            "store": task.store,
            "sequence_id": task.sequence_id, "layers": list(task.layers),
            "configs": list(task.configs)}
    schema = sweep_schema(options.bootstrap > 0).with_metadata({META_KEY: json.dumps(meta)})
    a, b = task.configs
    n = 0
    with atomic_output(path, unique=True) as fh, pq.ParquetWriter(
            fh, schema, compression="zstd") as writer:
        for batch in iter_replay(store, policies[a:b], seeds=seeds, layers=task.layers,
                                 sequences=[task.sequence_id], per_seed=per_seed,
                                 progress=False, options=options):
            extra = [pa.array([task.store] * batch.num_rows, pa.string()),
                     pa.array([task.model_id] * batch.num_rows, pa.string())]
            writer.write_batch(pa.RecordBatch.from_arrays(
                extra + list(batch.columns), schema=schema))
            n += batch.num_rows
        if n != task.rows:
            raise RuntimeError(f"task {task.path}: wrote {n} rows, expected {task.rows}")
    return {"key": task.key, "rows": n, "seconds": time.perf_counter() - t0,
            "cpu_s": time.process_time() - c0, "pid": os.getpid()}
