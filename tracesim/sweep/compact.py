"""The final step: compact task files into one Parquet file and write ``summary.json``.

Only the files of the current plan's tasks are read (stale files of earlier specs are ignored),
each is checked against its task (key, row count), and rows are written in a fixed order
(store, sequence, layer, configuration chunk), to a temp file that is fsynced and renamed. So
``results/results.parquet`` holds every task's rows exactly once, or does not exist.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from tracesim.atomic import atomic_output, atomic_write_bytes
from tracesim.safeio import loads_json
from tracesim.sweep.tasks import META_KEY, Task, sweep_schema

__all__ = ["RESULTS_FILE", "SUMMARY_FILE", "compact", "tasks_digest", "write_json"]

RESULTS_FILE = "results/results.parquet"
SUMMARY_FILE = "results/summary.json"


def tasks_digest(tasks: Sequence[Task]) -> str:
    """sha256 of the sorted task keys: identifies the exact set of task files compacted."""
    return hashlib.sha256("\n".join(sorted(t.key for t in tasks)).encode()).hexdigest()


def write_json(path: Path, doc: Any) -> None:
    """Write JSON atomically (temp + fsync + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode(),
                       unique=True)


def compact(out_dir: Path, tasks: Sequence[Task], store_order: Sequence[str],
            dest: Path | None = None) -> int:
    """Concatenate the task files into ``results/results.parquet`` (or ``dest``: the sweep
    stages it with its summary, :func:`tracesim.atomic.atomic_files`); return its row count.

    Raises
    ------
    RuntimeError
        If a task file is missing or does not match its task (nothing is written then).
    """
    out_dir = Path(out_dir)
    rank = {name: i for i, name in enumerate(store_order)}
    ordered = sorted(tasks, key=lambda t: (rank.get(t.store, len(rank)), t.sequence_id,
                                           t.layers, t.configs))
    path = Path(dest) if dest is not None else out_dir / RESULTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    # Every task of one spec shares its options, so the first file says whether the sweep
    # carries the bootstrap columns; the writer refuses a later file that differs.
    schema = sweep_schema(bool(ordered) and "boot_cov" in pq.ParquetFile(
        out_dir / ordered[0].path).schema_arrow.names)
    rows = 0
    with atomic_output(path, unique=True) as fh, pq.ParquetWriter(
            fh, schema, compression="zstd") as writer:
        for task in ordered:
            f = pq.ParquetFile(out_dir / task.path)
            meta = loads_json((f.schema_arrow.metadata or {}).get(META_KEY, b"{}"),
                              f"{task.path}: metadata {META_KEY}")
            if meta.get("key") != task.key or f.metadata.num_rows != task.rows:
                raise RuntimeError(f"{task.path}: does not match its task (key "
                                   f"{meta.get('key')} vs {task.key}, rows "
                                   f"{f.metadata.num_rows} vs {task.rows})")
            for i in range(f.num_row_groups):
                writer.write_table(f.read_row_group(i).replace_schema_metadata(None))
            rows += task.rows
    return rows
