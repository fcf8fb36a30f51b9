"""Tensor files: named numpy arrays in an Arrow IPC file, one record batch per tensor.

A tensor file is an uncompressed Arrow IPC *file* whose schema has a single non-nullable
``uint8`` column ``data``. Each record batch holds the raw little-endian bytes of one C-ordered
tensor. The schema metadata key ``tracesim.index`` holds a JSON object::

    {"format": "tracesim-tensors", "schema_version": 1,
     "tensors": {"k/0/0": {"batch": 0, "shape": [1024, 64], "dtype": "float16"}, ...},
     ...free-form extra keys (e.g. "sequence_id")}

Reading memory-maps the file and views one batch's buffer as a numpy array without copying, so
memory stays bounded by the tensors actually touched.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .format import SCHEMA_VERSION, STORAGE_DTYPES, ModelMeta, StoreError, storage_dtype

INDEX_KEY = b"tracesim.index"
TENSOR_FORMAT = "tracesim-tensors"
COLUMN = "data"
TENSOR_SCHEMA = pa.schema([pa.field(COLUMN, pa.uint8(), nullable=False)])


def tensor_name(kind: str, layer: int, head: int | None = None) -> str:
    """Index name of a tensor, e.g. ``k/3/1`` or ``o_proj/3``."""
    return f"{kind}/{layer}" if head is None else f"{kind}/{layer}/{head}"


# (index kind, field name, per-kv-head?) in the batch order of a sequence file's layer.
SEQUENCE_KINDS = (
    ("k", "keys", True),
    ("v", "values", True),
    ("q", "queries", False),
    ("o", "outputs", False),
    ("h2o", "h2o", False),
)


def sequence_layout(
    model: ModelMeta, n_positions: int, n_query: int
) -> list[tuple[str, tuple[int, ...], str, str]]:
    """Tensors of a sequence file in batch order: ``(name, shape, dtype, description)``.

    Per layer ``0..n_layers-1``: keys and values of every KV head, then queries, outputs and
    h2o scores of every query head. ``description`` reads e.g. ``field 'keys' of layer 3 kv
    head 1`` (for messages).
    """
    m = model
    out = []
    for layer in range(m.n_layers):
        for kind, field, per_kv in SEQUENCE_KINDS:
            if kind == "h2o":
                shape, dtype = (n_positions,), "float32"
            else:
                rows = n_positions if per_kv else n_query
                shape, dtype = (rows, m.head_dim), m.dtype
            word = "kv head" if per_kv else "head"
            for head in range(m.n_kv_heads if per_kv else m.n_heads):
                desc = f"field {field!r} of layer {layer} {word} {head}"
                out.append((tensor_name(kind, layer, head), shape, dtype, desc))
    return out


def make_index(entries: Iterable[tuple[str, tuple[int, ...], str]]) -> dict[str, dict[str, Any]]:
    """Index dict from ``(name, shape, dtype)`` triples in batch order."""
    index: dict[str, dict[str, Any]] = {}
    for batch, (name, shape, dtype) in enumerate(entries):
        if name in index:
            raise ValueError(f"duplicate tensor name {name!r}")
        index[name] = {"batch": batch, "shape": [int(s) for s in shape], "dtype": dtype}
    return index


class TensorFileWriter:
    """Stream tensors into a new tensor file, in the batch order fixed by ``index``.

    Parameters
    ----------
    path : Path
        File to create (truncated if present). Callers write to a temp name and rename.
    index : dict
        ``name -> {"batch", "shape", "dtype"}`` with batches ``0..len(index)-1``.
    label : str
        File name used in error messages.
    extra : dict, optional
        Additional JSON-able keys stored in the index metadata.
    """

    def __init__(
        self, path: Path, index: dict[str, dict[str, Any]], label: str, extra: dict | None = None
    ) -> None:
        self._index = index
        self._order = sorted(index, key=lambda n: index[n]["batch"])
        self._label = label
        meta = {"format": TENSOR_FORMAT, "schema_version": SCHEMA_VERSION, **(extra or {})}
        meta["tensors"] = index
        schema = TENSOR_SCHEMA.with_metadata({INDEX_KEY: json.dumps(meta).encode()})
        self._schema = schema
        self._fh = open(path, "wb")
        try:
            options = pa.ipc.IpcWriteOptions(compression=None)
            self._writer = pa.ipc.new_file(self._fh, schema, options=options)
        except BaseException:
            self._fh.close()
            raise
        self._next = 0

    @property
    def n_written(self) -> int:
        """Number of tensors written so far."""
        return self._next

    def write(self, name: str, array: np.ndarray) -> None:
        """Append tensor ``name``; it must be the next one in index order, of its shape/dtype."""
        expected = self._order[self._next] if self._next < len(self._order) else None
        if name != expected:
            raise StoreError(f"{self._label}: tensor {name!r} written out of order, expected "
                             f"{expected!r}")
        entry = self._index[name]
        dtype = storage_dtype(entry["dtype"])
        if tuple(array.shape) != tuple(entry["shape"]) or array.dtype != dtype:
            raise StoreError(
                f"{self._label}: tensor {name!r} has shape {tuple(array.shape)} {array.dtype}, "
                f"expected {tuple(entry['shape'])} {entry['dtype']}"
            )
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        batch = pa.record_batch([pa.array(raw, type=pa.uint8())], schema=self._schema)
        self._writer.write_batch(batch)
        self._next += 1

    def close(self) -> None:
        """Write the footer, flush and fsync; every tensor of the index must have been written."""
        if self._next != len(self._order):
            missing = self._order[self._next]
            self.abort()
            raise StoreError(f"{self._label}: tensor {missing!r} was never written")
        self._writer.close()
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()

    def abort(self) -> None:
        """Close without caring about the content (the caller removes the file)."""
        try:
            self._writer.close()
        except Exception:
            pass
        self._fh.close()


def write_tensor_file(
    path: Path, tensors: dict[str, np.ndarray], label: str, extra: dict | None = None
) -> None:
    """Write all ``tensors`` (name -> array in a storage dtype) at once, in dict order."""
    index = make_index((n, a.shape, a.dtype.name) for n, a in tensors.items())
    writer = TensorFileWriter(path, index, label, extra)
    try:
        for name, array in tensors.items():
            writer.write(name, array)
    except BaseException:
        writer.abort()
        raise
    writer.close()


def _parse_index(raw: bytes | None, n_batches: int, label: str) -> dict[str, Any]:
    if raw is None:
        raise StoreError(f"{label}: schema metadata has no {INDEX_KEY.decode()!r} key")
    from .safe import loads_bounded

    meta = loads_bounded(raw, f"{label}: index metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("tensors"), dict):
        raise StoreError(f"{label}: index metadata has no 'tensors' object")
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise StoreError(
            f"{label}: index field 'schema_version' is {meta.get('schema_version')!r}, "
            f"expected {SCHEMA_VERSION}"
        )
    seen: set[int] = set()
    for name, entry in meta["tensors"].items():
        ok = (
            isinstance(entry, dict)
            and type(entry.get("batch")) is int
            and 0 <= entry["batch"] < n_batches
            and entry["batch"] not in seen
            and isinstance(entry.get("shape"), list)
            and all(type(s) is int and s >= 0 for s in entry["shape"])
            and entry.get("dtype") in STORAGE_DTYPES
        )
        if not ok:
            raise StoreError(
                f"{label}: index entry {name!r} is {entry!r}, expected "
                f"{{'batch': 0..{n_batches - 1} (unique), 'shape': [ints >= 0], "
                f"'dtype': one of {STORAGE_DTYPES}}}"
            )
        seen.add(entry["batch"])
    return meta


class TensorFile:
    """Read-only, memory-mapped view of a tensor file.

    Parameters
    ----------
    path : Path
        The file.
    label : str
        Name used in error messages (e.g. ``seq/abc.arrow``).

    Raises
    ------
    StoreError
        If the file is not a readable Arrow IPC file or its index is malformed.
    """

    def __init__(self, path: Path, label: str) -> None:
        self.label = label
        from tracesim.sizes import ARROW_FOOTER_BYTES, arrow_footer_bytes, check_estimate

        try:
            # the footer holds the schema and its JSON index: bounded before Arrow reads it
            footer = arrow_footer_bytes(path)
            if footer is not None:
                check_estimate(footer, ARROW_FOOTER_BYTES, f"{label}: index (Arrow footer)",
                               "schema and tensor index", StoreError)
            self._source = pa.memory_map(str(path), "r")
            self._reader = pa.ipc.open_file(self._source)
        except FileNotFoundError:
            raise StoreError(f"{label}: file is missing") from None
        except (OSError, pa.ArrowException) as exc:
            raise StoreError(f"{label}: not a readable Arrow IPC file ({exc}), expected a "
                             "tracesim tensor file") from None
        schema = self._reader.schema
        if schema.remove_metadata() != TENSOR_SCHEMA:
            raise StoreError(
                f"{label}: schema is {schema.remove_metadata()}, expected one non-null uint8 "
                f"column {COLUMN!r}"
            )
        n_batches = self._reader.num_record_batches
        self.meta = _parse_index((schema.metadata or {}).get(INDEX_KEY), n_batches, label)
        self.index: dict[str, dict[str, Any]] = self.meta["tensors"]
        self.n_batches = n_batches

    def read(
        self,
        name: str,
        expected_shape: tuple[int, ...] | None = None,
        expected_dtype: str | None = None,
        field: str | None = None,
    ) -> np.ndarray:
        """Zero-copy, read-only view of tensor ``name``.

        Parameters
        ----------
        name : str
            Index name, e.g. ``"k/3/1"``.
        expected_shape, expected_dtype : optional
            Checked against the index; a mismatch raises :class:`StoreError`.
        field : str, optional
            Human name of the tensor for error messages (defaults to ``name``).

        Returns
        -------
        numpy.ndarray
            Array of the index shape and dtype backed by the memory map (``flags.owndata`` is
            False and it is not writeable).
        """
        what = field or f"tensor {name!r}"
        entry = self.index.get(name)
        if entry is None:
            raise StoreError(f"{self.label}: {what} is missing from the index")
        shape = tuple(entry["shape"])
        if expected_shape is not None and shape != tuple(expected_shape):
            raise StoreError(f"{self.label}: {what} has shape {shape}, expected "
                             f"{tuple(expected_shape)}")
        if expected_dtype is not None and entry["dtype"] != expected_dtype:
            raise StoreError(f"{self.label}: {what} has dtype {entry['dtype']}, expected "
                             f"{expected_dtype}")
        dtype = storage_dtype(entry["dtype"])
        try:
            column = self._reader.get_batch(entry["batch"]).column(0)
        except (OSError, pa.ArrowException) as exc:
            raise StoreError(f"{self.label}: {what} cannot be read ({exc})") from None
        n_bytes = math.prod(shape) * dtype.itemsize
        if len(column) != n_bytes or column.null_count:
            raise StoreError(
                f"{self.label}: {what} batch holds {len(column)} bytes "
                f"({column.null_count} null), expected {n_bytes} for shape {shape} {dtype.name}"
            )
        # A view of the data buffer (zero copy, read-only); Array.to_numpy would import pandas.
        raw = np.frombuffer(column.buffers()[1], dtype=np.uint8, count=n_bytes,
                            offset=column.offset)
        return raw.view(dtype).reshape(shape)
