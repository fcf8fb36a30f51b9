"""Writing one sequence of a trace store: :class:`SequenceWriter`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tracesim.atomic import fsync_dir, tmp_path

from .format import SCHEMA_VERSION, ModelMeta, StoreError, sha256_file, storage_dtype
from .manifest import DERIVED_FIELDS, check_row, coerce_field, missing_fields
from .tensorfile import (
    SEQUENCE_KINDS,
    TensorFileWriter,
    make_index,
    sequence_layout,
    tensor_name,
)

_LAYER_FIELDS = ("keys", "values", "queries", "outputs", "h2o")


class SequenceOwner(Protocol):
    """What a :class:`SequenceWriter` needs of the store writer that opened it
    (:class:`tracesim.store.writer.TraceWriter`): the store's path and model, the slot of its
    one open sequence, and the commit of a finished sequence's manifest row."""

    path: Path
    model: ModelMeta
    _active: SequenceWriter | None

    def _commit_row(self, row: dict[str, Any]) -> None: ...


class SequenceWriter:
    """Writes one sequence's tensor file; created by :meth:`TraceWriter.sequence`.

    Layers stream to ``seq/<name>.arrow.tmp`` as they are added, so memory stays bounded by one
    layer. On normal exit of the ``with`` block the file is fsynced and renamed into place and
    then the manifest row is added; on an exception the temp file is removed.
    """

    def __init__(self, owner: SequenceOwner, sequence_id: str, file: str, row: dict) -> None:
        self._owner = owner
        self.sequence_id = sequence_id
        self.file = file
        self._final = owner.path / file
        self._tmp = tmp_path(self._final)
        self._row: dict[str, Any] = {"sequence_id": sequence_id}
        self._tensors: TensorFileWriter | None = None
        self._next_layer = 0
        self._done = False
        self.update(**row)

    @property
    def _label(self) -> str:
        return f"{self.file} [sequence {self.sequence_id!r}]"

    def update(self, **fields: Any) -> None:
        """Set or replace manifest fields (checked immediately for type and consistency)."""
        row = dict(self._row)
        for name, value in fields.items():
            if name in DERIVED_FIELDS or name == "sequence_id":
                raise StoreError(f"{self._label}: field {name!r} is set by the store, "
                                 "expected it not to be given")
            row[name] = coerce_field(name, value, self._label)
        problems = check_row(row, self._label)
        if problems:
            raise StoreError("; ".join(problems))
        self._row = row

    def _expected_sizes(self, keys: np.ndarray, queries: np.ndarray) -> tuple[int, int]:
        n_pos = self._row.get("n_positions")
        if n_pos is None:
            n_pos = len(self._row["token_ids"]) if "token_ids" in self._row else None
        n_query = self._row.get("n_query")
        if n_query is None:
            qp = self._row.get("query_positions")
            n_query = len(qp) if qp is not None else None
        if n_pos is None:
            n_pos = keys.shape[1] if keys.ndim == 3 else -1
        if n_query is None:
            n_query = queries.shape[1] if queries.ndim == 3 else -1
        return n_pos, n_query

    def add_layer(
        self,
        layer: int,
        *,
        keys: np.ndarray,
        values: np.ndarray,
        queries: np.ndarray,
        outputs: np.ndarray,
        h2o: np.ndarray,
    ) -> None:
        """Add the tensors of ``layer`` (layers go in order ``0..n_layers-1``).

        Parameters
        ----------
        layer : int
            Layer index; must be the next one.
        keys, values : numpy.ndarray
            ``(n_kv_heads, n_positions, head_dim)`` post-RoPE keys and the values.
        queries : numpy.ndarray
            ``(n_heads, n_query, head_dim)`` post-RoPE queries at ``query_positions``.
        outputs : numpy.ndarray
            ``(n_heads, n_query, head_dim)`` full-cache attention outputs, before o_proj.
        h2o : numpy.ndarray
            ``(n_heads, n_positions)`` accumulated post-softmax attention of prefill queries.

        Raises
        ------
        StoreError
            On a wrong layer, shape, dtype, NaN/Inf (also after casting to float16) or a
            negative h2o score. The layer is then not added; the sequence stays usable.
        """
        if self._done:
            raise StoreError(f"{self._label}: sequence writer is already closed")
        m = self._owner.model
        if layer != self._next_layer:
            raise StoreError(f"{self._label}: add_layer got layer {layer}, expected layer "
                             f"{self._next_layer} (layers go in order 0..{m.n_layers - 1})")
        given = dict(zip(_LAYER_FIELDS, (keys, values, queries, outputs, h2o), strict=True))
        arrays = {k: np.asarray(v) for k, v in given.items()}
        n_pos, n_query = self._expected_sizes(arrays["keys"], arrays["queries"])
        expected = {
            "keys": (m.n_kv_heads, n_pos, m.head_dim),
            "values": (m.n_kv_heads, n_pos, m.head_dim),
            "queries": (m.n_heads, n_query, m.head_dim),
            "outputs": (m.n_heads, n_query, m.head_dim),
            "h2o": (m.n_heads, n_pos),
        }
        cast: dict[str, np.ndarray] = {}
        for name, arr in arrays.items():
            where = f"{self._label}: field {name!r} of layer {layer}"
            if arr.shape != expected[name]:
                raise StoreError(f"{where} has shape {arr.shape}, expected {expected[name]}")
            if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
                raise StoreError(f"{where} has dtype {arr.dtype}, expected floating point")
            dtype = storage_dtype("float32" if name == "h2o" else m.dtype)
            with np.errstate(over="ignore", invalid="ignore"):
                out = np.ascontiguousarray(arr, dtype=dtype)
            if not np.isfinite(out).all():
                cause = "overflows " + m.dtype if np.isfinite(arr).all() else "holds NaN/Inf"
                raise StoreError(f"{where} {cause}, expected finite values")
            if name == "h2o" and (out < 0).any():
                raise StoreError(f"{where} holds negative scores, expected >= 0")
            cast[name] = out
        if self._tensors is None:
            self._open(n_pos, n_query)
        assert self._tensors is not None
        for kind, name, per_kv in SEQUENCE_KINDS:
            for head in range(m.n_kv_heads if per_kv else m.n_heads):
                self._tensors.write(tensor_name(kind, layer, head), cast[name][head])
        self._next_layer += 1

    def _open(self, n_pos: int, n_query: int) -> None:
        m = self._owner.model
        self._row.setdefault("n_positions", n_pos)
        self._row.setdefault("n_query", n_query)
        layout = sequence_layout(m, n_pos, n_query)
        index = make_index((name, shape, dtype) for name, shape, dtype, _ in layout)
        extra = {"sequence_id": self.sequence_id, "model_id": m.model_id}
        self._tensors = TensorFileWriter(self._tmp, index, self.file, extra)

    def commit(self) -> None:
        """Finish: check the row, fsync and rename the file, then add the manifest row."""
        if self._done:
            raise StoreError(f"{self._label}: sequence writer is already closed")
        try:
            self._commit()
        except BaseException:
            self.abort()
            raise

    def _commit(self) -> None:
        m = self._owner.model
        if self._next_layer != m.n_layers:
            raise StoreError(f"{self._label}: {self._next_layer} layer(s) were added, expected "
                             f"n_layers = {m.n_layers}")
        assert self._tensors is not None
        row = dict(self._row)
        row.update(model_id=m.model_id, dtype=m.dtype, schema_version=SCHEMA_VERSION,
                   file=self.file, checksum="sha256:" + "0" * 64, n_bytes=0)
        missing = missing_fields(row)
        if missing:
            raise StoreError(f"{self._label}: manifest field(s) {missing} were never given")
        problems = check_row(row, self._label)
        if problems:
            raise StoreError("; ".join(problems))
        self._tensors.close()
        self._tensors = None
        row["checksum"] = sha256_file(self._tmp)
        row["n_bytes"] = self._tmp.stat().st_size
        os.replace(self._tmp, self._final)
        fsync_dir(self._final.parent)
        try:
            self._owner._commit_row(row)
        except BaseException:
            self._final.unlink(missing_ok=True)
            raise
        self._done = True
        self._owner._active = None

    def abort(self) -> None:
        """Discard this sequence: remove the temp file; nothing is added. Idempotent."""
        if self._tensors is not None:
            self._tensors.abort()
            self._tensors = None
        self._tmp.unlink(missing_ok=True)
        self._done = True
        if self._owner._active is self:
            self._owner._active = None

    def __enter__(self) -> SequenceWriter:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> bool:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.commit()
        return False
