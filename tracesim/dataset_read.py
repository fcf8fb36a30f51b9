"""Reading a results dataset (``OUT/results/``, written by :mod:`tracesim.dataset`): the
manifest checked, then every part verified one at a time, never the whole table in memory.

:func:`verify_dataset` checks the chain summary -> manifest -> part: every part present, of
its recorded size, sha256, schema, run and task; its rows only of its own store, sequence,
layers and configurations, each result key once; no configuration listed without rows; no
file in ``parts/`` that the manifest does not list. Any reader (DuckDB, polars, pandas, Dask)
can read ``parts/*.parquet`` directly once that check passed. :func:`read_results` reads small
results (a dataset or the single file of an earlier version) into one table.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tracesim.dataset import (
    DATASET_FORMAT,
    DATASET_VERSION,
    MANIFEST_FILE,
    META_KEY,
    PARTS_DIR,
    schema_doc,
)
from tracesim.errors import UsageError
from tracesim.safeio import loads_json

__all__ = ["LEGACY_RESULT_FILES", "MAX_MANIFEST_BYTES", "dataset_columns", "dataset_parts",
           "part_meta", "read_dataset", "read_results", "verify_dataset"]

_PART_NAME = re.compile(r"^parts/part-[0-9]{5,9}\.parquet$")
#: Largest manifest read (a part entry is ~300 bytes: ~10^6 parts).
MAX_MANIFEST_BYTES = 512 << 20
_schema_doc = schema_doc


def part_meta(f: pq.ParquetFile, where: str) -> dict[str, Any]:
    raw = (f.metadata.metadata or {}).get(META_KEY)  # the file's key-value metadata
    if raw is None:
        raise UsageError(f"{where}: field {META_KEY.decode()!r} (Parquet metadata) is missing, "
                         "expected the task record a sweep worker writes")
    meta = loads_json(raw, f"{where}: metadata {META_KEY.decode()}")
    if not isinstance(meta, dict):
        raise UsageError(f"{where}: metadata {META_KEY.decode()} is not an object")
    return meta


def _fail(where: Path | str, field: str, got: Any, expected: str) -> UsageError:
    return UsageError(f"{where}: field {field!r} is {got!r}, expected {expected}")


def _load_manifest(results_dir: Path) -> dict[str, Any]:
    from tracesim.safeio import read_json

    path = results_dir / MANIFEST_FILE
    doc = read_json(path, "results manifest", limit=MAX_MANIFEST_BYTES, intern=True)
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: expected a JSON object at the top level")
    if doc.get("format") != DATASET_FORMAT:
        raise _fail(path, "format", doc.get("format"), repr(DATASET_FORMAT))
    if doc.get("version") != DATASET_VERSION:
        raise _fail(path, "version", doc.get("version"), str(DATASET_VERSION))
    parts = doc.get("parts")
    if not isinstance(parts, list) or not parts:
        raise _fail(path, "parts", type(parts).__name__, "a non-empty list of parts")
    ids = doc.get("config_ids")
    if not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
        raise _fail(path, "config_ids", type(ids).__name__, "a list of strings")
    schema = doc.get("schema")
    if not (isinstance(schema, list) and all(
            isinstance(c, list) and len(c) == 2 and all(isinstance(s, str) for s in c)
            for c in schema)):
        raise UsageError(f"{path}: field 'schema' is not a list of [name, type], expected the "
                         "schema of the parts")
    keys = doc.get("key_columns", [])
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise _fail(path, "key_columns", keys, "a list of the column names that identify a row")
    seen: set[str] = set()
    for i, part in enumerate(parts):
        where = f"{path}: parts[{i}]"
        if not isinstance(part, dict):
            raise UsageError(f"{where}: is {type(part).__name__}, expected an object")
        name = part.get("file")
        if not (isinstance(name, str) and _PART_NAME.match(name)):
            raise _fail(where, "file", name, "'parts/part-NNNNN.parquet'")
        if name in seen:
            raise _fail(where, "file", name, "each part listed once (it is listed twice)")
        seen.add(name)
        for fld, kind in (("rows", int), ("sha256", str), ("key", str), ("store", str),
                          ("sequence_id", str), ("layers", list), ("config_ids", list)):
            value = part.get(fld)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise _fail(where, fld, value, f"a {kind.__name__}")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in part["layers"]):
            raise _fail(where, "layers", part["layers"], "a list of layer numbers")
        if not all(isinstance(v, str) for v in part["config_ids"]):
            raise _fail(where, "config_ids", part["config_ids"], "a list of strings")
    return doc


def dataset_parts(results_dir: str | os.PathLike) -> list[Path]:
    """The part files a manifest lists, in order (the manifest is checked, the parts not: run
    :func:`verify_dataset` before trusting them)."""
    d = Path(results_dir)
    return [d / p["file"] for p in _load_manifest(d)["parts"]]


def dataset_columns(results_dir: str | os.PathLike) -> list[str]:
    """The column names a manifest records (unverified, as :func:`dataset_parts`)."""
    return [c[0] for c in _load_manifest(Path(results_dir))["schema"]]


def verify_dataset(results_dir: str | os.PathLike, summary: dict[str, Any] | None,
                   summary_path: str | os.PathLike, *, configs: str | os.PathLike | None = None,
                   trust_unsigned: bool = False, required: dict[str, str] | None = None
                   ) -> tuple[list[Path], list[str]]:
    """Check a results dataset part by part; return (its parts in order, notes).

    Memory is one part's key columns at a time. ``summary`` (None: there is none) must record
    the manifest's sha256 (unless ``trust_unsigned``, which notes it instead); ``configs`` is
    the run's ``configs.json`` (rows of a configuration it does not list are refused).

    Raises
    ------
    tracesim.errors.UsageError
        One line naming the part (or manifest) and the field.
    """
    import pyarrow.compute as pc

    from tracesim.digests import sha256_file
    from tracesim.integrity import (
        _KINDS,
        KEY_COLUMNS,
        REQUIRED_COLUMNS,
        _check_keys,
        _configs_json_ids,
    )

    d = Path(results_dir)
    summary_path = Path(summary_path)
    mpath = d / MANIFEST_FILE
    notes: list[str] = []
    record = summary if isinstance(summary, dict) and "results_sha256" in summary else None
    if record is None:
        if not trust_unsigned:
            raise UsageError(f"{summary_path}: field 'results_sha256' is missing, expected the "
                             f"sha256 of {mpath.name} (written by tracesim sweep; rerun it, or "
                             "pass --trust-unsigned)")
        notes.append(f"UNSIGNED RESULTS: {mpath} has no sha256 in {summary_path}; its parts "
                     "were checked against it but it was taken on trust")
    else:
        if record.get("results_file") != MANIFEST_FILE:
            raise _fail(summary_path, "results_file", record.get("results_file"),
                        f"{MANIFEST_FILE!r} (the summary describes other results)")
        digest = sha256_file(mpath, "results manifest")
        if record["results_sha256"] != digest:
            raise UsageError(f"{summary_path}: field 'results_sha256' is "
                             f"{record['results_sha256']}, expected {digest} (the sha256 of "
                             f"{mpath.name}: the results changed after the summary was "
                             "written)")
    manifest = _load_manifest(d)
    listed_ids = set(manifest["config_ids"])
    if record is not None:
        if record.get("n_rows") != manifest.get("n_rows"):
            raise _fail(summary_path, "n_rows", record.get("n_rows"),
                        f"{manifest.get('n_rows')} (the rows {MANIFEST_FILE} records)")
        if sorted(set(record.get("config_ids") or [])) != sorted(listed_ids):
            raise UsageError(f"{summary_path}: field 'config_ids' differs from {mpath}'s, "
                             "expected the same configuration ids")
    known = _configs_json_ids(Path(configs)) if configs is not None else None
    if known is not None:
        foreign = sorted(listed_ids - known)
        if foreign:
            raise UsageError(f"{mpath}: field 'config_ids' holds {len(foreign)} "
                             f"configuration(s) not in {configs} field 'configs' (e.g. "
                             f"{foreign[0]!r}), expected only the configurations that run "
                             "produced")
    keys = tuple(manifest.get("key_columns") or KEY_COLUMNS)
    parts = manifest["parts"]
    on_disk = {p.name for p in (d / PARTS_DIR).glob("*")} if (d / PARTS_DIR).is_dir() else set()
    extra = sorted(on_disk - {Path(p["file"]).name for p in parts})
    if extra:
        raise UsageError(f"{d / PARTS_DIR / extra[0]}: is not listed in {mpath} field 'parts', "
                         f"expected only the parts of one run ({len(extra)} unlisted file(s); "
                         "a reader of parts/*.parquet would mix them in)")
    need = {"config_id": "string", **(REQUIRED_COLUMNS if required is None else required)}
    names = {c[0]: c[1] for c in manifest["schema"]}
    for col in need:
        if col not in names:
            raise UsageError(f"{mpath}: field 'schema' lacks column {col!r}, expected a "
                             f"{need[col]} column")
    # (store, sequence, layer) -> the configurations seen there, one bit each (a set of
    # (store, sequence, layer, configuration) tuples held ~100 bytes per part and configuration)
    bit = {cid: i for i, cid in enumerate(sorted(listed_ids))}
    cells: dict[tuple, int] = {}
    total = 0
    seen_ids: set[str] = set()
    paths: list[Path] = []
    for part in parts:
        path = d / part["file"]
        where = path
        if not path.is_file() or path.is_symlink():
            raise UsageError(f"{where}: is missing (or not a regular file), expected the part "
                             f"of {part['rows']} rows that {mpath.name} lists")
        digest = sha256_file(path, "results part")
        if digest != part["sha256"]:
            raise UsageError(f"{where}: field 'sha256' is {digest}, expected {part['sha256']} "
                             f"as {mpath.name} records (the part was edited, truncated or "
                             "replaced)")
        try:
            f = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as exc:
            raise UsageError(f"{where}: not a readable Parquet file ({exc})") from None
        with f:
            meta = part_meta(f, str(where))
            if meta.get("key") != part["key"]:
                raise _fail(where, "key", meta.get("key"),
                            f"{part['key']!r} as {mpath.name} records (a part of another task)")
            if "run_id" in manifest:
                # a sweep's task files name their run by its spec hash
                got = meta.get("run_id", meta.get("spec_hash"))
                if got != manifest["run_id"]:
                    raise _fail(where, "run_id", got, f"{manifest['run_id']!r} as "
                                f"{mpath.name} records (a part of another run)")
            if "spec_hash" in manifest and meta.get("spec_hash") != manifest["spec_hash"]:
                raise _fail(where, "spec_hash", meta.get("spec_hash"),
                            f"{manifest['spec_hash']!r} (a part of another sweep)")
            if f.metadata.num_rows != part["rows"]:
                raise _fail(where, "rows", f.metadata.num_rows,
                            f"{part['rows']} as {mpath.name} records")
            if _schema_doc(f.schema_arrow) != manifest["schema"]:
                raise UsageError(f"{where}: schema differs from {mpath.name} field 'schema', "
                                 "expected the same columns and types in every part")
            for col, kind in need.items():
                typ = f.schema_arrow.field(col).type
                if not any(test(typ) for test in _KINDS[kind]):
                    raise UsageError(f"{where}: column {col!r} has type {typ}, expected a "
                                     f"{kind} column")
            cols = [c for c in dict.fromkeys(("store", "sequence_id", "layer", "config_id",
                                              *keys)) if c in names]
            table = f.read(columns=cols)
        total += table.num_rows
        if table.num_rows == 0:
            continue
        for col, want in (("store", part["store"]), ("sequence_id", part["sequence_id"])):
            if col in table.column_names:
                got = pc.unique(table[col]).to_pylist()
                if got != [want]:
                    bad = next((g for g in got if g != want), None)
                    raise _fail(where, col, bad, f"only {want!r} as {mpath.name} records")
        layers = set(pc.unique(table["layer"]).to_pylist())
        if not layers <= set(part["layers"]):
            raise _fail(where, "layer", sorted(layers - set(part["layers"]))[0],
                        f"one of {part['layers']} as {mpath.name} records")
        ids = set(pc.unique(table["config_id"]).to_pylist())
        own = set(part["config_ids"])
        if ids != own:
            bad = sorted(str(i) for i in (ids - own) or (own - ids))[0]
            raise UsageError(
                f"{where}: column 'config_id' "
                + (f"holds {bad!r}, not in" if ids - own else f"has no rows of {bad!r}, listed in")
                + f" {mpath.name} field 'config_ids' of this part, expected exactly the "
                "configurations listed for it")
        if not own <= listed_ids:
            raise UsageError(f"{mpath}: part {part['file']} lists configuration "
                             f"{sorted(own - listed_ids)[0]!r} not in field 'config_ids'")
        seen_ids |= own
        own_mask = sum(1 << bit[cid] for cid in own)
        for layer in layers:
            key = (part["store"], part["sequence_id"], layer)
            have = cells.get(key, 0)
            if have & own_mask:
                cell = (*key, next(c for c in own if have >> bit[c] & 1))
                raise UsageError(f"{where}: rows of {cell} are also in an earlier part, "
                                 "expected each (store, sequence, layer, configuration) in "
                                 "one part (a part duplicated?)")
            cells[key] = have | own_mask
        _check_keys(table, path, keys)
        paths.append(path)
    if total != manifest.get("n_rows"):
        raise _fail(mpath, "n_rows", manifest.get("n_rows"), f"{total} (the rows of its parts)")
    if total == 0:
        raise UsageError(f"{mpath}: its parts hold 0 rows, expected at least one result row")
    if seen_ids != listed_ids:
        raise UsageError(f"{mpath}: field 'config_ids' lists "
                         f"{sorted(listed_ids - seen_ids)[0]!r} "
                         f"({len(listed_ids - seen_ids)} id(s)) with no rows in any part, "
                         "expected only configurations that have rows")
    return paths, notes


def read_dataset(parts: Sequence[Path], columns: Sequence[str] | None = None) -> pa.Table:
    """The rows of verified ``parts`` as one table, in order (part metadata dropped)."""
    tables = []
    for path in parts:
        with pq.ParquetFile(path) as f:
            tables.append(f.read(columns=list(columns) if columns else None)
                          .replace_schema_metadata(None))
    return pa.concat_tables(tables)


LEGACY_RESULT_FILES = ("results/results.parquet", "results.parquet", "replay.parquet",
                       "peers.parquet")


def read_results(directory: str | os.PathLike, columns: Sequence[str] | None = None, *,
                 required: dict[str, str] | None = None) -> pa.Table:
    """The rows of the results in ``directory`` (a sweep, replay or peers output) as one table:
    its dataset ``results/`` verified part by part against its signed summary
    (:func:`verify_dataset`), or the single file of an earlier version
    as it is. For small results (tests, notebooks): it holds every row asked for; large ones
    are read with a streaming engine (``docs/sweeps.md``).

    Raises
    ------
    tracesim.errors.UsageError
        No results there, or a part refused (the message names the part and the field).
    """
    from tracesim.safeio import read_json

    d = Path(directory)
    res = d / "results"
    if (res / MANIFEST_FILE).is_file():
        summary_path = res / "summary.json"
        summary = read_json(summary_path, "results summary") if summary_path.is_file() else None
        configs = res / "configs.json" if (res / "configs.json").is_file() else d / "configs.json"
        parts, _ = verify_dataset(res, summary if isinstance(summary, dict) else None,
                                  summary_path, configs=configs if configs.is_file() else None,
                                  required={} if required is None else required)
        return read_dataset(parts, columns)
    for name in LEGACY_RESULT_FILES:
        if (d / name).is_file():
            return pq.read_table(d / name, columns=list(columns) if columns else None)
    raise UsageError(f"{d}: no results found, expected {res / MANIFEST_FILE} or one of "
                     f"{list(LEGACY_RESULT_FILES)}")
