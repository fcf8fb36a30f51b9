"""A sweep's results as a dataset: one Parquet part per task plus a manifest, never one big file.

Layout of ``OUT/results/`` (``docs/sweeps.md``, ``docs/columns.md``)::

    manifest.json            format, run, schema, config ids, and per part: file, rows, sha256,
                             task key, store, sequence, layers, configuration ids
    summary.json             the sweep summary; results_file = "manifest.json" and its sha256
    parts/part-00000.parquet one file per task, in a fixed order (store, sequence, layers,
                             configuration chunk): the task file itself (a hard link; a copy
                             where the file system has none)

Writing needs no memory in proportion to the rows: parts are linked (or copied in blocks) and
hashed in 1 MiB blocks. The whole directory is built in a stage beside ``results/`` and swapped
in with two renames, so earlier results stay intact until the new set is complete (disk full
while copying leaves them as they were). Reading verifies the chain summary -> manifest ->
part, one part at a time: :func:`tracesim.dataset_read.verify_dataset`, re-exported here.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from tracesim.atomic import STAGE_PREFIX, TMP_SUFFIX
from tracesim.dataset import (  # the one writer: constants re-exported for readers
    DATASET_FORMAT,
    MANIFEST_FILE,
    PARTS_DIR,
    publish,
    schema_doc,
)
from tracesim.dataset_read import (  # the reading side, re-exported for the sweep's callers
    dataset_columns,
    dataset_parts,
    part_meta,
    read_dataset,
    verify_dataset,
)
from tracesim.sweep.tasks import Task

__all__ = ["DATASET_FORMAT", "MANIFEST_FILE", "PARTS_DIR", "dataset_columns", "dataset_parts",
           "read_dataset", "verify_dataset", "write_dataset"]

_schema_doc = schema_doc


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # no hard links here (or another file system): copy in blocks
        shutil.copyfile(src, dst)
        fd = os.open(dst, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_dataset(out_dir: Path, tasks: Sequence[Task], store_order: Sequence[str],
                  config_ids: Sequence[str], run: dict[str, str],
                  summary_doc: Any) -> int:
    """Publish the task files of ``tasks`` as ``out_dir/results`` (parts, manifest, summary).

    ``config_ids`` are the spec's expanded configuration ids (a task's ``configs`` index them);
    ``run`` identifies the run (``spec_hash``, ``tasks_digest``); ``summary_doc(record)``
    returns the summary document given the results record (``results_file``,
    ``results_sha256``, ``n_rows``, ``config_ids``). Returns the row count.

    Raises
    ------
    RuntimeError
        A task file is missing or does not match its task (nothing changes then).
    OSError
        Writing failed (e.g. disk full); earlier results are left as they were.
    """
    from tracesim.digests import sha256_file

    out_dir = Path(out_dir)
    rank = {name: i for i, name in enumerate(store_order)}
    ordered = sorted(tasks, key=lambda t: (rank.get(t.store, len(rank)), t.sequence_id,
                                           t.layers, t.configs))
    width = max(5, len(str(max(len(ordered) - 1, 0))))
    tag = f"{os.getpid()}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"
    stage = out_dir / f"{STAGE_PREFIX}results.{tag}"
    try:
        (stage / PARTS_DIR).mkdir(parents=True)
        parts: list[dict[str, Any]] = []
        schema: list[list[str]] | None = None
        rows = 0
        for i, task in enumerate(ordered):
            src = out_dir / task.path
            f = pq.ParquetFile(src)
            meta = part_meta(f, task.path)
            if meta.get("key") != task.key or f.metadata.num_rows != task.rows:
                raise RuntimeError(f"{task.path}: does not match its task (key "
                                   f"{meta.get('key')} vs {task.key}, rows "
                                   f"{f.metadata.num_rows} vs {task.rows})")
            doc = _schema_doc(f.schema_arrow)
            if schema is None:
                schema = doc
            elif doc != schema:
                raise RuntimeError(f"{task.path}: schema differs from the first task file's")
            name = f"{PARTS_DIR}/part-{i:0{width}d}.parquet"
            _link_or_copy(src, stage / name)
            a, b = task.configs
            parts.append({"file": name, "rows": task.rows,
                          "sha256": sha256_file(stage / name, "results part"),
                          "key": task.key, "store": task.store,
                          "sequence_id": task.sequence_id, "layers": list(task.layers),
                          "config_ids": sorted(set(config_ids[a:b]))})
            rows += task.rows
        return publish(out_dir, stage, parts, schema=schema or [], config_ids=config_ids,
                       run={"run_id": run["spec_hash"], **run}, summary_doc=summary_doc)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


