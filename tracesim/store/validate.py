"""Full consistency check of a trace store: :func:`validate_store`.

Unlike the reader, which trusts what it is asked to read, validation reads every byte: schema
version, ``model.json`` fields, manifest columns and row consistency, file presence, size and
checksum, tensor index, shapes and dtypes against the model and the manifest, NaN/Inf, and the
h2o scores' invariants. It never raises on a malformed store; it reports.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .format import (
    MANIFEST_FILE,
    O_PROJ_FILE,
    SCHEMA_VERSION,
    ModelMeta,
    StoreError,
    member_path,
    sha256_file,
)
from .manifest import NULLABLE, check_checksum, check_row, check_schema
from .safe import member_file, parse_model_json
from .tensorfile import TensorFile, sequence_layout, tensor_name

MAX_PROBLEMS_PER_FILE = 20
H2O_RTOL = 0.01  # h2o sums may differ from prompt_length by 1% (+0.01) for rounding


def validate_store(path: str | os.PathLike[str], *, check_data: bool = True) -> list[str]:
    """Check a trace store and list every problem found.

    Parameters
    ----------
    path : str or Path
        Store directory.
    check_data : bool, default True
        Also verify checksums and scan every tensor for NaN/Inf and the h2o invariants (reads
        the whole store, one tensor at a time). False checks structure only.

    Returns
    -------
    list of str
        Problems, each naming the file and field and what was expected; empty if valid.
    """
    root = Path(path)
    if not root.is_dir():
        return [f"{root}: not a directory, expected a trace store"]
    problems: list[str] = []
    model, raw, model_problems = parse_model_json(root)
    problems += model_problems
    table = _load_manifest(root, problems)
    if model is not None and raw.get("o_proj") is not None:
        problems += _cap(_check_o_proj(root, model, raw["o_proj"], check_data), O_PROJ_FILE)
    if model is None or table is None:
        return problems
    seen_ids: set[str] = set()
    seen_files: set[str] = set()
    for i in range(table.num_rows):
        row = table.slice(i, 1).to_pylist()[0]
        found = _check_sequence(root, model, row, i, check_data, seen_ids, seen_files)
        problems += _cap(found, str(row.get("file")))
    return problems


def _cap(problems: list[str], what: str) -> list[str]:
    if len(problems) <= MAX_PROBLEMS_PER_FILE:
        return problems
    extra = len(problems) - MAX_PROBLEMS_PER_FILE
    return [*problems[:MAX_PROBLEMS_PER_FILE], f"{what}: ... and {extra} more problem(s)"]


def _load_manifest(root: Path, problems: list[str]) -> pa.Table | None:
    try:
        member_file(root, MANIFEST_FILE)
        table = pq.read_table(root / MANIFEST_FILE)
    except StoreError as exc:
        problems.append(str(exc))
        return None
    except FileNotFoundError:
        problems.append(f"{MANIFEST_FILE}: missing, expected one row per finished sequence")
        return None
    except (OSError, pa.ArrowException) as exc:
        problems.append(f"{MANIFEST_FILE}: not readable Parquet ({exc})")
        return None
    schema_problems = check_schema(table.schema)
    problems += schema_problems
    return None if schema_problems else table


def _check_sequence(
    root: Path,
    model: ModelMeta,
    row: dict[str, Any],
    i: int,
    check_data: bool,
    seen_ids: set[str],
    seen_files: set[str],
) -> list[str]:
    sid = row.get("sequence_id")
    label = f"{MANIFEST_FILE}: row {i} (sequence {sid!r})"
    nulls = [k for k, v in row.items() if v is None and k not in NULLABLE]
    if nulls:
        return [f"{label}: field(s) {nulls} are null, expected values"]
    p: list[str] = []
    if sid in seen_ids:
        p.append(f"{label}: field 'sequence_id' is a duplicate, expected unique ids")
    seen_ids.add(sid)
    p += check_row(row, label)
    for field, expected in (("model_id", model.model_id), ("dtype", model.dtype),
                            ("schema_version", SCHEMA_VERSION)):
        if row[field] != expected:
            p.append(f"{label}: field {field!r} is {row[field]!r}, expected {expected!r}")
    p += check_checksum(row["checksum"], label)
    try:
        path = member_path(root, row["file"], label)
    except StoreError as exc:
        return [*p, str(exc)]
    name = row["file"]
    if name.lower() in seen_files:
        p.append(f"{label}: field 'file' {name!r} is shared with another row, expected unique")
    seen_files.add(name.lower())
    try:
        size = member_file(root, name).st_size
    except FileNotFoundError:
        return [*p, f"{name}: file is missing (listed for sequence {sid!r} in {MANIFEST_FILE})"]
    except StoreError as exc:
        return [*p, str(exc)]
    if not (0 <= row["n_positions"] < 2**31 and 0 <= row["n_query"] < 2**31):
        return p
    if size != row["n_bytes"]:
        p.append(f"{name}: file has {size} bytes, expected n_bytes = {row['n_bytes']} "
                 "(truncated or rewritten?)")
    item = 2 if model.dtype == "float16" else 4
    need = model.n_layers * (2 * model.n_kv_heads * row["n_positions"] * model.head_dim * item
                             + 2 * model.n_heads * row["n_query"] * model.head_dim * item
                             + model.n_heads * row["n_positions"] * 4)
    if size < need:
        p.append(f"{name}: file has {size} bytes, expected at least {need} for the shapes "
                 f"declared by model.json and {MANIFEST_FILE}")
    if check_data:
        digest = sha256_file(path)
        if digest != row["checksum"]:
            p.append(f"{name}: field 'checksum' of the file bytes is {digest}, expected "
                     f"{row['checksum']} (corrupted or rewritten?)")
    return p + _check_sequence_file(path, name, model, row, check_data)


def _check_sequence_file(
    path: Path, name: str, model: ModelMeta, row: dict[str, Any], check_data: bool
) -> list[str]:
    try:
        tf = TensorFile(path, name)
    except StoreError as exc:
        return [str(exc)]
    layout = sequence_layout(model, row["n_positions"], row["n_query"])
    p = _check_index(tf, name, [(n, s, d) for n, s, d, _ in layout])
    if p:
        return p
    prompt_length = row["prompt_length"]
    for tname, shape, dtype, desc in layout:
        try:
            arr = tf.read(tname, shape, dtype, desc)
        except StoreError as exc:
            p.append(str(exc))
            continue
        if not check_data:
            continue
        if tname.startswith("h2o/"):  # check_h2o reports non-finite scores itself
            p += check_h2o(arr, f"{name}: {desc}", prompt_length, model.sinks is not None)
        else:
            p += _finite(arr, f"{name}: {desc}")
        if len(p) > MAX_PROBLEMS_PER_FILE:
            break
    return p


def _check_index(tf: TensorFile, name: str, expected: list[tuple[str, tuple, str]]) -> list[str]:
    p = []
    want = {n: (tuple(s), d) for n, s, d in expected}
    missing = [n for n in want if n not in tf.index]
    extra = [n for n in tf.index if n not in want]
    if missing:
        p.append(f"{name}: index lacks {len(missing)} tensor(s) (first {missing[:3]}), "
                 f"expected {len(want)} tensors for this model")
    if extra:
        p.append(f"{name}: index has unexpected tensor(s) {extra[:3]}")
    if tf.n_batches != len(tf.index):
        p.append(f"{name}: file holds {tf.n_batches} record batches, expected "
                 f"{len(tf.index)} (one per indexed tensor)")
    for n, (shape, dtype) in want.items():
        entry = tf.index.get(n)
        if entry is not None and (tuple(entry["shape"]), entry["dtype"]) != (shape, dtype):
            p.append(f"{name}: tensor {n!r} has shape {tuple(entry['shape'])} "
                     f"{entry['dtype']}, expected {shape} {dtype} (from model.json and "
                     f"{MANIFEST_FILE})")
    return p


def _finite(arr: np.ndarray, where: str) -> list[str]:
    finite = np.isfinite(arr)
    if finite.all():
        return []
    n_nan = int(np.isnan(arr).sum())
    n_inf = int(arr.size - finite.sum()) - n_nan
    return [f"{where} holds {n_nan} NaN and {n_inf} Inf value(s), expected finite values"]


def check_h2o(arr: np.ndarray, where: str, prompt_length: int, sinks: bool = False) -> list[str]:
    """h2o scores are finite, >= 0, zero after the prompt and sum to prompt_length (one per
    query; at most that with ``sinks``, whose share no key receives); the reader enforces the
    same rules (one list of problems, never two copies)."""
    if not np.isfinite(arr).all():
        return _finite(arr, where)
    p = []
    if (arr < 0).any():
        p.append(f"{where} holds negative scores, expected >= 0")
    if arr[prompt_length:].any():
        p.append(f"{where} is nonzero at positions >= prompt_length = {prompt_length}, "
                 "expected 0 (prefill queries cannot attend to later keys)")
    total = float(arr.sum(dtype=np.float64))
    slack = H2O_RTOL * prompt_length + 0.01
    if sinks and total <= prompt_length + slack:
        return p
    if abs(total - prompt_length) > slack:
        p.append(f"{where} sums to {total:.4g}, expected prompt_length = {prompt_length} "
                 "(each prefill query spreads one unit of attention)")
    return p


def _check_o_proj(root: Path, model: ModelMeta, entry: dict, check_data: bool) -> list[str]:
    path = root / O_PROJ_FILE
    try:
        size = member_file(root, O_PROJ_FILE).st_size
    except FileNotFoundError:
        return [f"{O_PROJ_FILE}: file is missing, expected by field 'o_proj' of model.json"]
    except StoreError as exc:
        return [str(exc)]
    p = []
    if size != entry["n_bytes"]:
        p.append(f"{O_PROJ_FILE}: file has {size} bytes, expected n_bytes = "
                 f"{entry['n_bytes']}")
    need = model.n_layers * model.hidden_size * model.n_heads * model.head_dim * 4
    if size < need:
        return [*p, f"{O_PROJ_FILE}: file has {size} bytes, expected at least {need} for the "
                "shapes declared by model.json"]
    if check_data and sha256_file(path) != entry["checksum"]:
        p.append(f"{O_PROJ_FILE}: checksum of the file bytes differs from model.json's "
                 f"{entry['checksum']} (corrupted or rewritten?)")
    try:
        tf = TensorFile(path, O_PROJ_FILE)
    except StoreError as exc:
        return [*p, str(exc)]
    shape = (model.hidden_size, model.n_heads * model.head_dim)
    expected = [(tensor_name("o_proj", layer), shape, "float32")
                for layer in range(model.n_layers)]
    idx = _check_index(tf, O_PROJ_FILE, expected)
    if idx:
        return p + idx
    for layer, (tname, _, _) in enumerate(expected):
        desc = f"field 'o_proj' of layer {layer}"
        try:
            arr = tf.read(tname, shape, "float32", desc)
        except StoreError as exc:
            p.append(str(exc))
            continue
        if check_data:
            p += _finite(arr, f"{O_PROJ_FILE}: {desc}")
    return p
