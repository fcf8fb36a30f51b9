"""Task partitioning: units of work, their deterministic file names, estimates and validation.

A task is one sequence × a chunk of layers × a chunk of configurations (all seeds). Layers are
replayed one at a time inside a task, and for each layer the full-cache logits and outputs are
computed once and shared by every configuration of the chunk, so peak memory is one layer's
working set. Configurations are split into chunks only when one layer with every configuration
would exceed ``partition.max_task_memory_mb`` (large grids, long contexts).

Each task writes one Parquet file, named from the store, the sequence, the layer chunk, the
configuration chunk and a key hashing everything its rows depend on (the spec's result hash,
the store's ``model.json`` and the sequence file's checksum). A file under that name is
complete (temp name + fsync + rename), so a rerun skips it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tracesim.dataset import META_KEY  # the part record key (Parquet key-value metadata)
from tracesim.digests import safe_file_stem
from tracesim.policies import Policy
from tracesim.policies.grid import SpecError
from tracesim.safeio import loads_json, read_bytes
from tracesim.sweep.spec import SweepSpec, code_fingerprint, selected_sequences

__all__ = ["META_KEY", "Task", "TaskPlan", "config_cost", "plan_tasks", "read_task_meta",
           "sweep_schema", "task_file_ok"]

_N_FIELDS = 18          # per-(iteration, head, query) float64 fields of the kernel's output
_ROW_BYTES = 8 * 64     # bytes per result row in flight (Arrow batch + numpy intermediates)


def sweep_schema(bootstrap: bool = False) -> pa.Schema:
    """Schema of task files and of the compacted results: ``store``, ``model_id``, replay's
    (with the bootstrap columns when ``bootstrap``, i.e. ``options.bootstrap > 0``)."""
    from tracesim.columns import describe_schema
    from tracesim.replay import result_schema

    return describe_schema(pa.schema([pa.field("store", pa.string()),
                                      pa.field("model_id", pa.string()),
                                      *result_schema(bootstrap)]))


@dataclass(frozen=True)
class Task:
    """One unit of work (picklable, small; the worker reads configs from ``configs.json``).

    Attributes
    ----------
    key : str
        16 hex digits identifying the task's content.
    path : str
        Task file, relative to the output directory.
    configs : tuple of (int, int)
        ``[start, stop)`` into the spec's expanded policies.
    rows : int
        Rows the task file must hold.
    work : float
        Estimated work (query × position × iteration evaluations, summed over layers).
    memory_mb : float
        Estimated peak working set of one layer of the task.
    """

    key: str
    store: str
    store_path: str
    model_id: str
    sequence_id: str
    layers: tuple[int, ...]
    configs: tuple[int, int]
    path: str
    rows: int
    work: float
    memory_mb: float


@dataclass(frozen=True)
class TaskPlan:
    """Every task of a sweep (largest estimated work first) plus totals for the dry run.

    ``code`` is the source fingerprint the result hash was computed with (workers check it).
    """

    tasks: tuple[Task, ...]
    spec_hash: str
    n_sequences: int
    n_layer_units: int
    n_query_evals: float
    code: str = ""

    @property
    def work(self) -> float:
        return float(sum(t.work for t in self.tasks))


def _safe(name: str) -> str:
    """A task directory name for a store label or sequence id."""
    return safe_file_stem(name, max_chars=80, digest_chars=8, strip_leading_dots=True)


def _evaluated(roles: list[str], wanted: tuple[str, ...] | None) -> int:
    """Number of evaluated queries (as :func:`tracesim.replay.evaluated_queries`)."""
    n = sum(r in (wanted or ("decode",)) for r in roles)
    if n == 0 and wanted is None:
        n = sum(r == "question_window" for r in roles)
    return n


def _iterations(p: Policy, n_seeds: int) -> int:
    return n_seeds if p.needs_seeds else 1


def config_cost(p: Policy, n_seeds: int, heads: int, n_kv: int, nq: int, P: int,
                 prompt: int, per_seed: bool) -> tuple[float, float, int]:
    """(work, bytes, rows) of one configuration on one layer."""
    it = _iterations(p, n_seeds)
    events = 1
    if p.schedule.kind == "decode":
        events += max(0, P - prompt) // int(p.schedule.every) + 1
    slots = n_seeds if p.score.seed_dependent else 1
    rows = (it if per_seed else 1) * heads * nq
    units = heads if p.score.per_query_head else n_kv  # inclusion tables per sample
    nbytes = it * heads * nq * _N_FIELDS * 8 + slots * events * units * P * 9 + rows * _ROW_BYTES
    return float(it * heads * nq * P), float(nbytes), rows


def _chunks(costs: list[float], limit: float) -> list[tuple[int, int]]:
    """Contiguous chunks of roughly equal cost, each (if possible) under ``limit``."""
    total = sum(costs)
    n = max(1, min(len(costs), math.ceil(total / max(limit, 1.0))))
    if n == 1:
        return [(0, len(costs))]
    bounds, acc, target = [0], 0.0, total / n
    for i, c in enumerate(costs):
        acc += c
        if acc >= target * len(bounds) and len(bounds) < n and i + 1 < len(costs):
            bounds.append(i + 1)
    bounds.append(len(costs))
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def check_policies_fit(policies: Sequence[Any], head_dim: int, store: str) -> None:
    """Refuse, at planning, a policy whose per-step proxy cannot serve the store's keys
    (``lowrank:r`` with ``r > head_dim``): every task would fail at run time otherwise.

    Raises
    ------
    SpecError
        Naming the configuration, the proxy and the store.
    """
    from tracesim.proxies import make_proxy

    for policy in policies:
        proxy = getattr(policy.score, "proxy", None)
        if proxy is None:
            continue
        try:
            make_proxy(proxy).check_head_dim(head_dim)
        except ValueError as exc:
            raise SpecError(f"grid: score {policy.score.label()} cannot run on store "
                            f"{store!r}: {exc}") from None


def plan_tasks(spec: SweepSpec) -> TaskPlan:
    """Partition a sweep into tasks (deterministic: depends on the spec and the stores only).

    Returns
    -------
    TaskPlan
        Tasks sorted by estimated work, largest first (longest-processing-time order).
    """
    from tracesim.store import open_store

    code = code_fingerprint()
    spec_hash = spec.result_hash(code)
    n_seeds = len(spec.seeds)
    tasks: list[Task] = []
    n_seq = n_units = 0
    evals = 0.0
    for ref in spec.stores:
        store = open_store(ref.path, require_rows=True)
        m = store.model
        check_policies_fit(spec.policies, m.head_dim, ref.name)
        model_json = read_bytes(ref.path / "model.json", 1 << 20, "store model.json")
        layers = list(spec.layers) if spec.layers is not None else list(range(m.n_layers))
        layer_chunks = [tuple(layers[i:i + spec.layers_per_task])
                        for i in range(0, len(layers), spec.layers_per_task)]
        manifest = {r["sequence_id"]: r for r in store.manifest.select(
            ["sequence_id", "query_roles", "n_positions", "prompt_length", "checksum"]
        ).to_pylist()}
        for sid in selected_sequences(store, spec.sequences):
            row = manifest[sid]
            n_seq += 1
            P, prompt = int(row["n_positions"]), int(row["prompt_length"])
            nq = _evaluated(list(row["query_roles"]), spec.options.roles)
            costs = [config_cost(p, n_seeds, m.n_heads, m.n_kv_heads, nq, P, prompt,
                                  spec.per_seed) for p in spec.policies]
            base = 8.0 * (2 * m.n_kv_heads * P * m.head_dim + 3 * m.n_heads * nq * P
                          + m.n_heads * P)
            limit = spec.max_task_memory_mb * 2**20 - base
            cfg_chunks = _chunks([c[1] for c in costs], limit)
            content = hashlib.sha256(model_json + str(row["checksum"]).encode()).hexdigest()
            for lc in layer_chunks:
                n_units += len(lc)
                evals += len(lc) * nq * m.n_heads * len(spec.policies) * n_seeds * P
                for a, b in cfg_chunks:
                    ident = json.dumps([spec_hash, content, ref.name, sid, list(lc), a, b])
                    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
                    span = f"L{lc[0]:03d}-{lc[-1]:03d}"
                    cfg = f"c{a}-{b - 1}"
                    tasks.append(Task(
                        key=key, store=ref.name, store_path=str(ref.path), model_id=m.model_id,
                        sequence_id=sid, layers=lc, configs=(a, b),
                        path=f"tasks/{_safe(ref.name)}/{_safe(sid)}/{span}_{cfg}_{key}.parquet",
                        rows=len(lc) * sum(c[2] for c in costs[a:b]),
                        work=len(lc) * (sum(c[0] for c in costs[a:b]) + m.n_heads * nq * P),
                        memory_mb=(base + sum(c[1] for c in costs[a:b])) / 2**20))
    tasks.sort(key=lambda t: (-t.work, t.path))
    return TaskPlan(tuple(tasks), spec_hash, n_seq, n_units, evals, code)


def read_task_meta(path: Path) -> dict | None:
    """The task metadata of a finished task file, or None if it is missing or unreadable."""
    try:
        md = pq.ParquetFile(path).metadata.metadata or {}
        return loads_json(md[META_KEY], f"{path}: metadata {META_KEY}")
    except (OSError, KeyError, ValueError, pa.ArrowException):
        return None


def task_file_ok(out_dir: Path, task: Task) -> bool:
    """Whether ``task``'s file exists and validates (footer, key, schema, row count)."""
    path = Path(out_dir) / task.path
    if not path.is_file():
        return False
    try:
        f = pq.ParquetFile(path)
        md = loads_json((f.schema_arrow.metadata or {})[META_KEY], f"{path}: metadata")
        return (md.get("key") == task.key and f.metadata.num_rows == task.rows
                and md.get("rows") == task.rows
                and any(f.schema_arrow.remove_metadata().equals(sweep_schema(b))
                        for b in (False, True)))
    except (OSError, KeyError, ValueError, pa.ArrowException):
        return False
