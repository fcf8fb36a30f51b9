"""The manifest: one Parquet row per finished sequence, its schema and its consistency rules."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tracesim.atomic import atomic_output

from .format import (
    MANIFEST_FILE,
    QUERY_ROLES,
    StoreError,
)

# (name, kind, arrow type written by tracesim). Kinds decide which types a reader accepts.
FIELDS: tuple[tuple[str, str, pa.DataType], ...] = (
    ("sequence_id", "str", pa.string()),
    ("task", "str", pa.string()),
    ("seed", "int", pa.int64()),
    ("length", "int", pa.int64()),
    ("token_ids", "int_list", pa.list_(pa.int32())),
    ("prompt_length", "int", pa.int64()),
    ("context_start", "int", pa.int64()),
    ("context_end", "int", pa.int64()),
    ("question_start", "int", pa.int64()),
    ("question_end", "int", pa.int64()),
    ("generated_ids", "int_list", pa.list_(pa.int32())),
    ("generated_logprobs", "float_list", pa.list_(pa.float32())),
    ("answer", "str", pa.string()),
    ("gold", "str", pa.string()),
    ("correct", "bool", pa.bool_()),
    ("query_positions", "int_list", pa.list_(pa.int32())),
    ("query_roles", "str_list", pa.list_(pa.string())),
    ("n_positions", "int", pa.int64()),
    ("n_query", "int", pa.int64()),
    ("model_id", "str", pa.string()),
    ("dtype", "str", pa.string()),
    ("schema_version", "int", pa.int64()),
    ("file", "str", pa.string()),
    ("checksum", "str", pa.string()),
    ("n_bytes", "int", pa.int64()),
)
KINDS = {name: kind for name, kind, _ in FIELDS}
#: Fields that may be null: prompts captured without a gold answer (``tracesim capture
#: --prompts``) have neither ``gold`` nor ``correct``.
NULLABLE = ("gold", "correct")
MANIFEST_SCHEMA = pa.schema([pa.field(n, t, nullable=n in NULLABLE) for n, _, t in FIELDS])
# Fields the store derives itself; ``n_positions``/``n_query`` may also be given (then checked).
DERIVED_FIELDS = ("model_id", "dtype", "schema_version", "file", "checksum", "n_bytes")
_CHECKSUM = re.compile(r"sha256:[0-9a-f]{64}")
_INT32 = (-(2**31), 2**31 - 1)


def _type_ok(kind: str, typ: pa.DataType) -> bool:
    t = pa.types
    if kind == "str":
        return t.is_string(typ) or t.is_large_string(typ)
    if kind == "int":
        return t.is_integer(typ)
    if kind == "bool":
        return t.is_boolean(typ)
    if not (t.is_list(typ) or t.is_large_list(typ)):
        return False
    value = typ.value_type
    return {
        "int_list": t.is_integer(value),
        "float_list": t.is_floating(value),
        "str_list": t.is_string(value) or t.is_large_string(value),
    }[kind]


def check_schema(schema: pa.Schema) -> list[str]:
    """Problems with a manifest schema: missing, unknown or wrongly typed columns."""
    problems = []
    for name, kind, typ in FIELDS:
        if name not in schema.names:
            problems.append(f"{MANIFEST_FILE}: column {name!r} is missing, expected {typ}")
        elif not _type_ok(kind, schema.field(name).type):
            problems.append(
                f"{MANIFEST_FILE}: column {name!r} has type {schema.field(name).type}, "
                f"expected {typ}"
            )
    extra = [n for n in schema.names if n not in KINDS]
    if extra:
        problems.append(f"{MANIFEST_FILE}: unknown column(s) {extra}, expected only {list(KINDS)}")
    return problems


def coerce_field(name: str, value: Any, label: str) -> Any:
    """Normalize one row value to its plain-Python form, or raise :class:`StoreError`."""
    kind = KINDS.get(name)
    if kind is None:
        raise StoreError(f"{label}: unknown field {name!r}, expected one of {list(KINDS)}")

    def bad(expected: str) -> StoreError:
        shown = repr(value)
        if len(shown) > 80:
            shown = f"{type(value).__name__} {shown[:60]}..."
        return StoreError(f"{label}: field {name!r} is {shown}, expected {expected}")

    if value is None and name in NULLABLE:
        return None
    if kind == "str":
        if not isinstance(value, str):
            raise bad("a str")
        return value
    if kind == "bool":
        if not isinstance(value, (bool, np.bool_)):
            raise bad("a bool")
        return bool(value)
    if kind == "int":
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise bad("an int")
        return int(value)
    if isinstance(value, (str, bytes)) or value is None:
        raise bad(f"a 1-D sequence ({kind})")
    if kind == "str_list":
        items = list(value)
        if not all(isinstance(v, str) for v in items):
            raise bad("a list of str")
        return items
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise bad(f"a 1-D sequence ({kind})")
    if arr.size == 0:
        return []
    if kind == "int_list":
        if arr.dtype.kind not in "iu":
            raise bad("a 1-D sequence of int")
        if arr.min() < _INT32[0] or arr.max() > _INT32[1]:
            raise bad("values within int32")
        return arr.astype(np.int64).tolist()
    if arr.dtype.kind not in "iuf":
        raise bad("a 1-D sequence of float")
    return arr.astype(np.float32).astype(np.float64).tolist()


def _le(row: dict[str, Any], a: str, b: str, problems: list[str], label: str) -> None:
    if a in row and b in row and row[a] > row[b]:
        problems.append(f"{label}: field {a!r} = {row[a]}, expected <= {b} = {row[b]}")


def check_row(row: dict[str, Any], label: str) -> list[str]:
    """Consistency problems of a (normalized, possibly partial) manifest row.

    Checks that need a missing field are skipped; :func:`missing_fields` reports absences.
    """
    p: list[str] = []
    n_pos = row.get("n_positions")
    if "token_ids" in row:
        if n_pos is not None and len(row["token_ids"]) != n_pos:
            p.append(f"{label}: field 'token_ids' has length {len(row['token_ids'])}, "
                     f"expected n_positions = {n_pos}")
        n_pos = len(row["token_ids"]) if n_pos is None else n_pos
    if n_pos is not None and n_pos < 1:
        p.append(f"{label}: field 'n_positions' = {n_pos}, expected >= 1")
    for name in ("token_ids", "generated_ids"):
        if row.get(name) and min(row[name]) < 0:
            p.append(f"{label}: field {name!r} holds a negative id, expected ids >= 0")
    for name in ("length", "context_start", "n_bytes", "n_query"):
        if name in row and row[name] < 0:
            p.append(f"{label}: field {name!r} = {row[name]}, expected >= 0")
    if row.get("prompt_length", 1) < 1:
        p.append(f"{label}: field 'prompt_length' = {row['prompt_length']}, expected >= 1")
    order = ("context_start", "context_end", "question_start", "question_end", "prompt_length")
    for a, b in zip(order, order[1:], strict=False):
        _le(row, a, b, p, label)
    if n_pos is not None and row.get("prompt_length", 0) > n_pos:
        p.append(f"{label}: field 'prompt_length' = {row['prompt_length']}, "
                 f"expected <= n_positions = {n_pos}")
    gen, lp = row.get("generated_ids"), row.get("generated_logprobs")
    if gen is not None and lp is not None and len(gen) != len(lp):
        p.append(f"{label}: field 'generated_logprobs' has length {len(lp)}, "
                 f"expected len(generated_ids) = {len(gen)}")
    if lp and not all(math.isfinite(x) and x <= 1e-3 for x in lp):
        p.append(f"{label}: field 'generated_logprobs' holds NaN/Inf or a positive value, "
                 "expected finite log-probabilities <= 0")
    qp, roles = row.get("query_positions"), row.get("query_roles")
    if qp is not None:
        if "n_query" in row and row["n_query"] != len(qp):
            p.append(f"{label}: field 'n_query' = {row['n_query']}, "
                     f"expected len(query_positions) = {len(qp)}")
        if any(b <= a for a, b in zip(qp, qp[1:], strict=False)):
            p.append(f"{label}: field 'query_positions' is not sorted and unique, "
                     "expected strictly increasing positions")
        if qp and (min(qp) < 0 or (n_pos is not None and max(qp) >= n_pos)):
            p.append(f"{label}: field 'query_positions' spans [{min(qp)}, {max(qp)}], "
                     f"expected positions in [0, n_positions = {n_pos})")
    if roles is not None:
        if qp is not None and len(roles) != len(qp):
            p.append(f"{label}: field 'query_roles' has length {len(roles)}, "
                     f"expected len(query_positions) = {len(qp)}")
        bad = sorted(set(roles) - set(QUERY_ROLES))
        if bad:
            p.append(f"{label}: field 'query_roles' holds {bad}, expected roles in {QUERY_ROLES}")
        if qp is not None and len(roles) == len(qp):
            p.extend(_check_roles(row, qp, roles, label))
    return p


def _check_roles(row: dict[str, Any], qp: list[int], roles: list[str], label: str) -> list[str]:
    """Each role's positions must lie where that role's window can be."""
    limits = {  # role -> (field, lower/upper, message)
        "context_window": ("question_start", "<", "before question_start"),
        "question_window": ("prompt_length", "<", "before prompt_length"),
        "decode": ("prompt_length", ">=", "at or after prompt_length"),
    }
    problems = []
    for role, (field, op, where) in limits.items():
        if field not in row:
            continue
        bound = row[field]
        wrong = [
            q
            for q, r in zip(qp, roles, strict=True)
            if r == role and (q >= bound if op == "<" else q < bound)
        ]
        if wrong:
            problems.append(f"{label}: field 'query_roles' marks position(s) {wrong[:5]} as "
                            f"{role!r}, expected {role} positions {where} = {bound}")
    return problems


def missing_fields(row: dict[str, Any]) -> list[str]:
    """Names of manifest fields absent from ``row``."""
    return [n for n in KINDS if n not in row]


def check_checksum(value: str, label: str) -> list[str]:
    """Problems with the form of a checksum string."""
    if not _CHECKSUM.fullmatch(value):
        return [f"{label}: field 'checksum' is {value!r}, expected 'sha256:<64 hex digits>'"]
    return []


def empty_manifest() -> pa.Table:
    """A manifest table with no rows."""
    return MANIFEST_SCHEMA.empty_table()


def read_manifest(root: Path) -> pa.Table:
    """Read ``manifest.parquet``, cast to :data:`MANIFEST_SCHEMA`; raise :class:`StoreError`."""
    from .safe import member_file

    path = root / MANIFEST_FILE
    try:
        st = member_file(root, MANIFEST_FILE)
        # ParquetFile, not read_table: read_table loads pyarrow.dataset, which imports pandas.
        with pq.ParquetFile(path) as fh:
            check_manifest_size(fh.metadata, st.st_size, path)  # the footer's counts first
            table = fh.read()
    except FileNotFoundError:
        raise StoreError(f"{root}: {MANIFEST_FILE} is missing, expected one row per "
                         "finished sequence") from None
    except (OSError, pa.ArrowException) as exc:
        raise StoreError(f"{root}: {MANIFEST_FILE} is not readable Parquet ({exc}), expected "
                         "the store's manifest") from None
    problems = check_schema(table.schema)
    if problems:
        raise StoreError(f"{root}: " + "; ".join(problems))
    try:
        return table.select(MANIFEST_SCHEMA.names).cast(MANIFEST_SCHEMA)
    except (pa.ArrowException, ValueError) as exc:
        raise StoreError(f"{root}: {MANIFEST_FILE} does not fit its schema ({exc})") from None


def check_manifest_size(meta: pq.FileMetaData | None, file_bytes: int, path: Path) -> None:
    """Bound a manifest by what its footer says before a row is decoded: file bytes, rows,
    list items (token ids, ...) and decoded bytes (:mod:`tracesim.sizes`).

    Raises
    ------
    StoreError
        Naming the file, the estimate and the limit.
    """
    from tracesim.sizes import (
        MANIFEST_BYTES,
        MANIFEST_DECODED_BYTES,
        MANIFEST_ROWS,
        MANIFEST_VALUES,
        check_estimate,
    )

    check_estimate(file_bytes, MANIFEST_BYTES, str(path), "manifest file", StoreError)
    if meta is None:
        return
    check_estimate(meta.num_rows, MANIFEST_ROWS, str(path), "rows (sequences)", StoreError,
                   unit="rows")
    values = decoded = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        decoded += group.total_byte_size
        for c in range(group.num_columns):
            column = group.column(c)
            if ".list." in column.path_in_schema:  # a list column's leaf: one per item
                values += column.num_values
    check_estimate(values, MANIFEST_VALUES, str(path), "list items (token ids, query "
                   "positions, ...)", StoreError, unit="items")
    check_estimate(decoded, MANIFEST_DECODED_BYTES, str(path), "decoded manifest data",
                   StoreError)


def write_manifest(root: Path, table: pa.Table) -> None:
    """Atomically replace ``manifest.parquet``: temp file, fsync, rename, fsync directory."""
    with atomic_output(root / MANIFEST_FILE) as fh:
        pq.write_table(table, fh)


def row_table(row: dict[str, Any]) -> pa.Table:
    """One-row manifest table from a complete, normalized row."""
    return pa.Table.from_pylist([row], schema=MANIFEST_SCHEMA)
