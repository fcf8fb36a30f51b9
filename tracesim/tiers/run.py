"""Run a tiers spec over a trace store: one Parquet part per (sequence, policy), then one file.

``OUT/parts/<n>.parquet`` is written atomically per sequence and policy, with the spec hash in
its metadata, so a killed run resumes where it stopped and a changed spec never mixes rows.
When every part exists they are concatenated into ``OUT/tiers.parquet`` and
``OUT/summary.json`` is written (both atomically). The shared output lock
(:class:`tracesim.atomic.DirLock`) refuses a second concurrent run on the same output.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tracesim.atomic import DirLock, atomic_files, atomic_parquet
from tracesim.columns import to_arrow
from tracesim.integrity import file_sha256
from tracesim.policies import Policy
from tracesim.replay import load_layer
from tracesim.tiers.schedulers import get_scheduler, in_process_schedulers
from tracesim.tiers.simulate import simulate_layer
from tracesim.tiers.spec import TiersSpec, parse_tiers_spec, seeds_array

__all__ = ["TIERS_COLUMNS", "compute_part", "run_tiers", "tiers_schema"]

#: Fixed columns of ``tiers.parquet`` (plus ``bytes_<tier>`` per lower tier), with descriptions.
TIERS_COLUMNS: dict[str, tuple[pa.DataType, str]] = {
    "sequence_id": (pa.string(), "sequence id"),
    "task": (pa.string(), "task of the sequence"),
    "correct": (pa.bool_(), "full-cache answer graded correct"),
    "config_id": (pa.string(), "base eviction policy (as in replay results)"),
    "layer": (pa.int32(), "layer"),
    "head": (pa.int32(), "query head"),
    "kv_head": (pa.int32(), "KV head the query head reads"),
    "step": (pa.int32(), "decode step (index among the evaluated decode queries)"),
    "query_position": (pa.int32(), "position of the decode query"),
    "scheduler": (pa.string(), "fetch scheduler"),
    "deployable": (pa.bool_(), "false for the oracle scheduler (reads the true attention)"),
    "fetch_budget": (pa.float64(), "byte budget of the step, fraction of the layer's evicted "
                                   "bytes"),
    "page": (pa.int32(), "positions per page"),
    "n_seeds": (pa.int32(), "seeds averaged (1 for deterministic base policies)"),
    "err2_before": (pa.float64(), "|o_hat - o|^2 of the plain eviction estimate"),
    "err2_after": (pa.float64(), "|o_hat - o|^2 after the step's fetches"),
    "cert2": (pa.float64(), "certificate tr V_hat before fetching (null if not certified)"),
    "bytes_moved": (pa.float64(), "bytes fetched for the row's KV head / group size (rows sum "
                                  "to the layer's bytes)"),
    "kv_bytes_moved": (pa.float64(), "bytes fetched for the row's KV head"),
    "pages_fetched": (pa.float64(), "pages fetched for the row's KV head"),
    "evicted_bytes": (pa.float64(), "bytes of the KV head's evicted pages visible to the step"),
    "fetch_ms": (pa.float64(), "modelled fetch time of the layer at this step, ms"),
    "stall_ms": (pa.float64(), "modelled stall of the layer at this step, ms (fetch time, less "
                               "the overlapped compute with overlap: true)"),
}


def tiers_schema(tier_names: tuple[str, ...]) -> pa.Schema:
    """Arrow schema of ``tiers.parquet`` for the given lower tiers (descriptions in metadata)."""
    fields = [pa.field(n, t, metadata={"description": d}) for n, (t, d) in TIERS_COLUMNS.items()]
    fields += [pa.field(f"bytes_{n}", pa.float64(),
                        metadata={"description": f"bytes fetched from {n} by the layer at this "
                                                 "step"}) for n in tier_names]
    return pa.schema(fields)


def _part_ok(path: Path, spec_hash: str) -> bool:
    if not path.is_file():
        return False
    try:
        meta = pq.read_schema(path).metadata or {}
    except Exception:
        return False
    return meta.get(b"spec_hash", b"").decode() == spec_hash


def _table(cols: dict[str, np.ndarray], schema: pa.Schema) -> pa.Table:
    """Columns in schema order, "not applicable" values as nulls (the shared rule)."""
    return pa.Table.from_arrays([to_arrow(f.name, cols[f.name], f.type) for f in schema],
                                schema=schema)


def _write_parquet(path: Path, tables: Iterable[pa.Table], schema: pa.Schema,
                   spec_hash: str) -> int:
    """Stream ``tables`` into one Parquet file that appears only complete (spec hash in its
    metadata); returns the number of rows."""
    schema = schema.with_metadata({**(schema.metadata or {}), b"spec_hash": spec_hash.encode()})
    rows = 0
    with atomic_parquet(path, schema, compression="zstd") as writer:
        for t in tables:
            writer.write_table(t.cast(schema))
            rows += t.num_rows
    return rows


def compute_part(spec: TiersSpec, store: Any, sid: str, policy: Policy, path: Path) -> int:
    """Simulate one (sequence, policy) over the spec's layers and write its part atomically.

    Returns the number of rows written.
    """
    n_layers = store.model.n_layers
    layers = list(range(n_layers)) if spec.layers is None else list(spec.layers)
    schema = tiers_schema(tuple(t.name for t in spec.memory.lower))
    not_deployable = [s for s in spec.schedulers if not get_scheduler(s).deployable]
    seq = store[sid]
    tables = []
    try:
        for layer in layers:
            trace = load_layer(store, seq, layer)
            cols = simulate_layer(trace, policy, seeds_array(spec), n_layers, spec.memory,
                                  spec.schedulers, np.asarray(spec.fetch_budgets))
            n = cols["head"].size
            meta = trace.meta
            cols.update({
                "sequence_id": np.full(n, sid, dtype=object),
                "task": np.full(n, str(meta.get("task", "")), dtype=object),
                "correct": np.full(n, bool(meta.get("correct", False))),
                "config_id": np.full(n, policy.id, dtype=object),
                "layer": np.full(n, layer, dtype=np.int32),
                "deployable": np.isin(cols["scheduler"], not_deployable, invert=True),
                "page": np.full(n, spec.memory.page, dtype=np.int32),
            })
            tables.append(_table(cols, schema))
    finally:
        seq.close()
    # unique temp names (atomic_parquet): a retried Dask task may race a lost worker on a part
    return _write_parquet(path, tables, schema, spec.spec_hash)


def _dask_part(raw: dict, source: str, store_path: str, sid: str, policy_json: str,
               path: str, spec_hash: str) -> int:
    """Worker side of the Dask backend: rebuild spec, store and policy from plain data; refuse
    when the worker's plugin schedulers differ from the driver's (``spec_hash``)."""
    from tracesim.store import open_store

    spec = parse_tiers_spec(raw, source)
    if spec.spec_hash != spec_hash:
        raise RuntimeError(f"tiers worker: the spec hashes to {spec.spec_hash[:12]} here but "
                           f"{spec_hash[:12]} on the driver: a plugin scheduler differs "
                           "between the two (install the same version everywhere)")
    policy = Policy.from_dict(json.loads(policy_json))
    return compute_part(spec, open_store(store_path), sid, policy, Path(path))


def run_tiers(spec: TiersSpec, store: Any, out: str | os.PathLike, *,
              backend: str = "local", workers: int = 1, scheduler: str | None = None,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Simulate every (sequence, policy, layer) of the spec and write ``OUT``.

    Parameters
    ----------
    spec : TiersSpec
    store : TraceStore
        An open trace store.
    out : path
        Output directory (created; resumed when it holds parts of the same spec).
    backend : {"local", "dask"}
        ``local`` runs the parts in this process; ``dask`` sends one task per (sequence,
        policy) to a :class:`distributed.LocalCluster` of ``workers`` single-threaded
        processes, or to the cluster at ``scheduler``. Results are identical either way.
    progress : callable, optional
        Called with a line of text after each finished part.

    Returns
    -------
    dict
        The summary written to ``OUT/summary.json``.
    """
    if backend not in ("local", "dask"):
        raise ValueError(f"backend = {backend!r}: expected 'local' or 'dask'")
    registered = in_process_schedulers(spec.schedulers)
    if backend == "dask" and registered:
        raise ValueError(f"schedulers {registered} are registered in this process only "
                         "(register_scheduler); Dask workers are other processes: declare "
                         "them under the entry-point group tracesim.schedulers, or use the "
                         "local backend")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    parts = out / "parts"
    parts.mkdir(exist_ok=True)
    lock = DirLock(out, "tiers")
    try:
        t0 = time.perf_counter()
        n_layers = store.model.n_layers
        layers = list(range(n_layers)) if spec.layers is None else list(spec.layers)
        bad = [x for x in layers if x >= n_layers]
        if bad:
            raise ValueError(f"layers {bad}: the store has {n_layers} layers")
        seq_ids = list(store.sequence_ids) if spec.sequences is None else list(spec.sequences)
        missing = [s for s in seq_ids if s not in store]
        if missing:
            raise ValueError(f"sequences not in the store: {missing[:5]}")
        for stale in parts.glob(".*.tmp"):      # under the lock: no other run is writing
            stale.unlink(missing_ok=True)
        files, todo = [], []
        for sid in seq_ids:
            for policy in spec.policies:
                key = hashlib.sha256(f"{sid}\0{policy.id}".encode()).hexdigest()[:24]
                path = parts / f"{key}.parquet"
                files.append(path)
                if not _part_ok(path, spec.spec_hash):
                    todo.append((sid, policy, path))
        done_before = len(files) - len(todo)
        if backend == "local":
            for sid, policy, path in todo:
                rows = compute_part(spec, store, sid, policy, path)
                if progress is not None:
                    progress(f"{sid} {policy.id}: {rows} rows")
        elif todo:
            _run_dask(spec, str(store.path), todo, workers, scheduler, progress)
        tier_names = tuple(t.name for t in spec.memory.lower)
        # one part in memory at a time
        # tiers.parquet and summary.json as one unit, the summary (with its sha256) last
        with atomic_files(out, ["tiers.parquet", "summary.json"]) as stage:
            n_rows = _write_parquet(stage / "tiers.parquet", (pq.read_table(f) for f in files),
                                    tiers_schema(tier_names), spec.spec_hash)
            summary = {"spec_hash": spec.spec_hash, "rows": n_rows,
                       "sequences": len(seq_ids), "policies": [p.id for p in spec.policies],
                       "layers": layers, "seeds": len(spec.seeds),
                       "schedulers": list(spec.schedulers),
                       "fetch_budgets": list(spec.fetch_budgets),
                       "memory": spec.memory.to_dict(), "parts_resumed": done_before,
                       "backend": backend, "seconds": round(time.perf_counter() - t0, 3),
                       "results_file": "tiers.parquet",
                       "results_sha256": file_sha256(stage / "tiers.parquet")}
            (stage / "summary.json").write_text(json.dumps(summary, indent=2, default=str)
                                                + "\n")
        return summary
    finally:
        lock.release()


def _run_dask(spec: TiersSpec, store_path: str, todo: list, workers: int,
              scheduler: str | None, progress: Callable[[str], None] | None) -> None:
    import logging

    import dask
    from distributed import Client, LocalCluster, as_completed

    cluster = None
    if scheduler is None:
        env = {n: "1" for n in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS",
                                "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
        with dask.config.set({"distributed.worker.profile.enabled": False}):
            cluster = LocalCluster(n_workers=max(1, int(workers)), threads_per_worker=1,
                                   processes=True, dashboard_address=None,
                                   silence_logs=logging.ERROR, env=env)
        client = Client(cluster)
    else:
        client = Client(scheduler, timeout="10s")
    try:
        futures, meta = [], {}
        for sid, policy, path in todo:
            fut = client.submit(_dask_part, spec.raw, "tiers spec", store_path, sid,
                                policy.to_json(), str(path), spec.spec_hash, pure=False,
                                retries=1)
            futures.append(fut)
            meta[fut.key] = (sid, policy)
        for fut in as_completed(futures):
            sid, policy = meta[fut.key]
            rows = fut.result()
            if progress is not None:
                progress(f"{sid} {policy.id}: {rows} rows")
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
