"""Writing a results dataset part by part as work finishes: the one writer of sweep, replay and
peers results.

Every tool publishes the same layout, ``OUT/results/`` (``docs/sweeps.md``)::

    manifest.json            format, run_id, schema, key columns, config ids; per part: file,
                             rows, sha256, key, store, sequence, layers, configuration ids
    summary.json             the tool's summary; results_file = "manifest.json" and its sha256
    parts/part-00000.parquet the parts, in a fixed order; each carries its record (key, run_id,
                             rows) in its Parquet key-value metadata

:class:`PartWriter` (replay, peers) writes each part into a build directory beside
``results/`` as soon as its work is done (temp file + fsync + rename), named by its place in
the run's fixed order, so the rows and their order do not depend on the number of workers or
threads. A rerun with the same run id keeps the parts already there (resume after kill -9 or
disk full); another run id starts afresh. :func:`publish` writes the manifest and summary
into the build directory and swaps it in for ``results/`` with two renames: the earlier
results stay whole until the new set is complete. Nothing here holds more than one record
batch; hashing reads 1 MiB blocks. The sweep links its task files into a build directory and
publishes it with the same :func:`publish`. Readers check a dataset with
:func:`tracesim.dataset_read.verify_dataset`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tracesim.atomic import TMP_SUFFIX, atomic_output, atomic_write_bytes, fsync_dir

__all__ = ["BUILD_DIR", "DATASET_FORMAT", "DATASET_VERSION", "MANIFEST_FILE", "META_KEY",
           "PARTS_DIR", "PartWriter", "publish", "run_id_of"]

#: ``format`` field of a results manifest (with ``version``).
DATASET_FORMAT = "tracesim-results-dataset"
DATASET_VERSION = 1
MANIFEST_FILE = "manifest.json"
PARTS_DIR = "parts"
#: Where :class:`PartWriter` builds the next ``results/`` (kept between runs to resume).
BUILD_DIR = ".results.build"
_RUN_FILE = "run.json"
#: Parquet key-value metadata key of a part's record (``key``, ``run_id``, ``rows``, ...); the
#: name is the sweep task files' (a sweep's parts are its task files).
META_KEY = b"tracesim.sweep.task"


def run_id_of(doc: Any) -> str:
    """The run id of a run described by the JSON document ``doc`` (its inputs and options):
    sha256 of its canonical JSON. Same inputs, same id: a rerun resumes its own parts only."""
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def schema_doc(schema: pa.Schema) -> list[list[str]]:
    """``[[name, type], ...]`` of a schema (the manifest's ``schema`` field)."""
    return [[f.name, str(f.type)] for f in schema.remove_metadata()]


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def part_name(index: int, width: int = 5) -> str:
    """``parts/part-NNNNN.parquet`` of the part at ``index`` of a run's fixed order."""
    return f"{PARTS_DIR}/part-{index:0{width}d}.parquet"


def part_entry(path: Path, name: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The manifest entry of a finished part (its sha256 read in 1 MiB blocks)."""
    from tracesim.digests import sha256_file

    return {"file": name, "rows": int(meta["rows"]),
            "sha256": sha256_file(path, "results part"), "key": meta["key"],
            "store": meta["store"], "sequence_id": meta["sequence_id"],
            "layers": list(meta["layers"]), "config_ids": list(meta["config_ids"])}


class PartWriter:
    """Parts of one run written into ``OUT/.results.build`` as work finishes.

    ``run_id`` (:func:`run_id_of`) identifies the run: parts left by an interrupted run with
    the same id are kept (:meth:`finished`), those of another run removed. ``schema`` is every
    part's schema; ``width`` the digits of the part numbers (from the number of parts).
    """

    def __init__(self, out_dir: str | os.PathLike, run_id: str, schema: pa.Schema, *,
                 width: int = 5) -> None:
        self.out_dir = Path(out_dir)
        self.run_id = run_id
        self.schema = schema
        self.width = width
        self.build = self.out_dir / BUILD_DIR
        run_file = self.build / _RUN_FILE
        same = False
        if self.build.is_dir() and run_file.is_file():
            try:
                same = json.loads(run_file.read_text()).get("run_id") == run_id
            except (OSError, ValueError, AttributeError):
                same = False
        if self.build.exists() and not same:
            shutil.rmtree(self.build)
        (self.build / PARTS_DIR).mkdir(parents=True, exist_ok=True)
        for stale in (self.build / PARTS_DIR).glob("*" + TMP_SUFFIX):  # a part cut short
            stale.unlink()
        if not same:
            atomic_write_bytes(run_file, json.dumps({"run_id": run_id}).encode())

    def finished(self, index: int, key: str) -> dict[str, Any] | None:
        """The manifest entry of part ``index`` if a complete part of this run and ``key`` is
        already there (resume), else None (a part of another run or key is removed)."""
        name = part_name(index, self.width)
        path = self.build / name
        if not path.is_file():
            return None
        try:
            with pq.ParquetFile(path) as f:
                meta = json.loads((f.metadata.metadata or {})[META_KEY])
                rows = f.metadata.num_rows
        except (OSError, ValueError, KeyError, pa.ArrowException):
            meta, rows = None, -1
        if not (isinstance(meta, dict) and meta.get("run_id") == self.run_id
                and meta.get("key") == key and meta.get("rows") == rows):
            path.unlink()
            return None
        return part_entry(path, name, meta)

    def write(self, index: int, key: str, batches: Iterable[pa.RecordBatch], *, store: str,
              sequence_id: str) -> dict[str, Any] | None:
        """Write part ``index`` from ``batches`` (temp + fsync + rename), one batch held at a
        time; return its manifest entry, or None when there were no rows (no part then).

        The part's record (key, run id, rows, layers, configurations) goes into the file's
        key-value metadata once the rows are written (it is known only then)."""
        import pyarrow.compute as pc

        name = part_name(index, self.width)
        path = self.build / name
        rows = 0
        layers: set[int] = set()
        ids: set[str] = set()
        schema = self.schema.remove_metadata()
        try:
            with atomic_output(path, unique=True) as fh, pq.ParquetWriter(
                    fh, schema, compression="zstd") as writer:
                for batch in batches:
                    if batch.num_rows == 0:
                        continue
                    batch = pa.RecordBatch.from_arrays(batch.columns, schema=schema)
                    rows += batch.num_rows
                    layers.update(pc.unique(batch.column("layer")).to_pylist())
                    ids.update(pc.unique(batch.column("config_id")).to_pylist())
                    writer.write_batch(batch)
                meta = {"key": key, "run_id": self.run_id, "rows": rows, "store": store,
                        "sequence_id": sequence_id, "layers": sorted(int(x) for x in layers),
                        "config_ids": sorted(ids)}
                writer.add_key_value_metadata({META_KEY: json.dumps(meta, sort_keys=True)})
                if rows == 0:
                    raise _Empty
        except _Empty:
            return None
        return part_entry(path, name, meta)


class _Empty(Exception):
    """A part with no rows (nothing is written: the temporary file is removed)."""


def publish(out_dir: str | os.PathLike, build: Path, parts: Sequence[dict[str, Any]], *,
            schema: list[list[str]], config_ids: Sequence[str], run: dict[str, Any],
            summary_doc: Callable[[dict[str, Any]], Any],
            key_columns: Sequence[str] | None = None,
            extra_files: dict[str, bytes] | None = None) -> int:
    """Write the manifest and summary into ``build`` and swap it in for ``OUT/results``.

    ``run`` holds ``run_id`` and any other identity fields (``spec_hash``); ``summary_doc(r)``
    returns the summary given the results record ``r`` (``results_file``, ``results_sha256``,
    ``n_rows``, ``config_ids``); ``extra_files`` are written beside them (``configs.json``).
    On any failure (disk full) the earlier ``results/`` is left as it was. Returns the rows.
    """
    from tracesim.atomic import STAGE_PREFIX
    from tracesim.digests import sha256_file

    out_dir = Path(out_dir)
    results = out_dir / "results"
    rows = sum(int(p["rows"]) for p in parts)
    manifest = {"format": DATASET_FORMAT, "version": DATASET_VERSION, **run,
                "n_rows": rows, "n_parts": len(parts), "config_ids": sorted(set(config_ids)),
                "schema": schema, "parts": list(parts)}
    if key_columns is not None:
        manifest["key_columns"] = list(key_columns)
    (build / _RUN_FILE).unlink(missing_ok=True)
    (build / MANIFEST_FILE).write_bytes(
        (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    record = {"results_file": MANIFEST_FILE,
              "results_sha256": sha256_file(build / MANIFEST_FILE, "results manifest"),
              "n_rows": rows, "config_ids": manifest["config_ids"]}
    files = {**(extra_files or {}), "summary.json": (
        json.dumps(summary_doc(record), indent=1, sort_keys=True) + "\n").encode()}
    for name, data in files.items():
        (build / name).write_bytes(data)
    for name in (MANIFEST_FILE, *files):
        _fsync(build / name)
    fsync_dir(build / PARTS_DIR)
    fsync_dir(build)
    old = out_dir / f"{STAGE_PREFIX}old-results.{os.getpid()}{TMP_SUFFIX}"
    shutil.rmtree(old, ignore_errors=True)
    try:
        # swap: the earlier results move aside, the new set takes their name, the old goes
        if results.exists() or results.is_symlink():
            os.replace(results, old)
        try:
            os.replace(build, results)
        except BaseException:
            if old.exists():
                os.replace(old, results)
            raise
        fsync_dir(out_dir)
    finally:
        shutil.rmtree(old, ignore_errors=True)
    return rows


#: Single results files of earlier versions, read where a directory has no results dataset.
