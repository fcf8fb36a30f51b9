"""Writing a trace store: :class:`TraceWriter` and its per-sequence :class:`SequenceWriter`."""

from __future__ import annotations

import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tracesim.atomic import TMP_SUFFIX, atomic_write_bytes, fsync_dir, tmp_path

from .format import (
    LOCK_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    O_PROJ_FILE,
    SEQ_DIR,
    TENSOR_SUFFIX,
    ModelMeta,
    StoreError,
    check_kept,
    check_sequence_id,
    model_json_bytes,
    safe_file_stem,
    sha256_file,
    storage_dtype,
)
from .manifest import (
    empty_manifest,
    read_manifest,
    row_table,
    write_manifest,
)
from .safe import read_model_json
from .sequence import SequenceWriter
from .tensorfile import TensorFile, tensor_name, write_tensor_file

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

class TraceWriter:
    """Create a trace store, or reopen one to resume an interrupted capture.

    Parameters
    ----------
    path : str or Path
        Store directory; created if missing.
    model : ModelMeta
        The traced model. On resume it must equal the stored one.
    o_proj : numpy.ndarray, optional
        ``(n_layers, hidden_size, n_heads * head_dim)`` output-projection weights, stored once
        as float32. On resume it must equal the stored one, if any.
    kept : dict, optional
        For a store of a subset of the model's layers / KV heads: which were kept
        (:func:`tracesim.store.format.kept_entry`); ``model`` then describes the stored subset.
        On resume it must equal the stored one.

    Raises
    ------
    StoreError
        If another writer holds the store's lock, the model or o_proj differ from the stored
        ones, or the directory is something other than a trace store.

    Notes
    -----
    Opening takes an exclusive lock (``.lock``, released by :meth:`close` or at process exit)
    and removes temporary files (``*.tmp``) a killed run left behind.
    """

    def __init__(
        self, path: str | os.PathLike[str], model: ModelMeta, o_proj: np.ndarray | None = None,
        kept: dict | None = None,
    ) -> None:
        if not isinstance(model, ModelMeta):
            raise TypeError(f"model must be a ModelMeta, got {type(model).__name__}")
        problems = check_kept(kept, model)
        if problems:
            raise StoreError("; ".join(problems))
        self.path = Path(path)
        self.model = model
        self.kept = kept
        self._active: SequenceWriter | None = None
        self._lock_fd: int | None = None
        self.path.mkdir(parents=True, exist_ok=True)
        self._acquire_lock()
        try:
            self._remove_temp_files()
            if (self.path / MODEL_FILE).exists():
                self._resume(o_proj)
            else:
                self._create(o_proj)
        except BaseException:
            self._release_lock()
            raise

    # ------------------------------------------------------------------ lifecycle

    def _acquire_lock(self) -> None:
        lock = self.path / LOCK_FILE
        busy = StoreError(
            f"{lock}: another TraceWriter holds the lock on this store; expected a single "
            "writer per store (close the other writer first)"
        )
        if fcntl is None:  # pragma: no cover - fallback without flock
            try:
                self._lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                raise busy from None
            return
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise busy from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is None:
            return
        os.close(self._lock_fd)  # closing the descriptor releases the flock
        self._lock_fd = None
        if fcntl is None:  # pragma: no cover
            (self.path / LOCK_FILE).unlink(missing_ok=True)

    def close(self) -> None:
        """Release the lock. An open sequence is aborted (not added). Idempotent."""
        if self._active is not None:
            self._active.abort()
        self._release_lock()

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._lock_fd is None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._release_lock()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _remove_temp_files(self) -> None:
        for folder in (self.path, self.path / SEQ_DIR):
            if folder.is_dir():
                for child in folder.iterdir():
                    if child.name.endswith(TMP_SUFFIX) and child.is_file():
                        child.unlink()

    def _create(self, o_proj: np.ndarray | None) -> None:
        allowed = {LOCK_FILE, SEQ_DIR, O_PROJ_FILE, MANIFEST_FILE}
        strangers = sorted(p.name for p in self.path.iterdir() if p.name not in allowed)
        seq = self.path / SEQ_DIR
        if seq.is_dir():
            strangers += [f"{SEQ_DIR}/{p.name}" for p in seq.iterdir()]
        if strangers:
            raise StoreError(
                f"{self.path}: not a trace store ({MODEL_FILE} is missing) and not empty "
                f"(found {strangers[:5]}); expected an empty or new directory"
            )
        seq.mkdir(exist_ok=True)
        o_proj_entry = self._write_o_proj(o_proj) if o_proj is not None else None
        write_manifest(self.path, empty_manifest())
        self._table = empty_manifest()
        atomic_write_bytes(self.path / MODEL_FILE,
                           model_json_bytes(self.model, o_proj_entry, self.kept))
        self._index_rows()

    def _resume(self, o_proj: np.ndarray | None) -> None:
        stored, raw = read_model_json(self.path)
        if stored.rope_theta is None and stored == replace(self.model, rope_theta=None,
                                                           rope_scaling=None):
            # A store written before the RoPE settings were recorded stays as it is.
            self.model = stored
        if stored != self.model:
            diff = [
                f"field {k!r} is {v!r}, expected {getattr(self.model, k)!r}"
                for k, v in asdict(stored).items()
                if v != getattr(self.model, k)
            ]
            raise StoreError(
                f"{self.path / MODEL_FILE}: stored model differs from the one given to "
                f"TraceWriter: {'; '.join(diff)}"
            )
        if raw.get("kept") != self.kept:
            raise StoreError(f"{self.path / MODEL_FILE}: field 'kept' is {raw.get('kept')!r}, "
                             f"expected {self.kept!r} (the same layers/heads on resume)")
        self._table = read_manifest(self.path)
        (self.path / SEQ_DIR).mkdir(exist_ok=True)
        self._index_rows()
        if o_proj is None:
            return
        if raw.get("o_proj") is None:
            entry = self._write_o_proj(o_proj)
            atomic_write_bytes(self.path / MODEL_FILE,
                               model_json_bytes(self.model, entry, self.kept))
            return
        new = self._check_o_proj(o_proj)
        stored_file = TensorFile(self.path / O_PROJ_FILE, O_PROJ_FILE)
        m = self.model
        shape = (m.hidden_size, m.n_heads * m.head_dim)
        for layer in range(m.n_layers):
            old = stored_file.read(tensor_name("o_proj", layer), shape, "float32")
            if not np.array_equal(old, new[layer]):
                raise StoreError(
                    f"{self.path / O_PROJ_FILE}: field 'o_proj' of layer {layer} differs from "
                    "the o_proj given to TraceWriter; expected identical weights on resume"
                )

    def _index_rows(self) -> None:
        ids = self._table.column("sequence_id").to_pylist()
        if len(set(ids)) != len(ids):
            raise StoreError(f"{self.path / MANIFEST_FILE}: field 'sequence_id' has duplicates")
        self._ids = set(ids)
        self._files = {f.lower() for f in self._table.column("file").to_pylist()}

    def _check_o_proj(self, o_proj: Any) -> np.ndarray:
        m = self.model
        arr = np.asarray(o_proj)
        expected = (m.n_layers, m.hidden_size, m.n_heads * m.head_dim)
        if arr.shape != expected:
            raise StoreError(f"{O_PROJ_FILE}: field 'o_proj' has shape {arr.shape}, "
                             f"expected {expected}")
        if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
            raise StoreError(f"{O_PROJ_FILE}: field 'o_proj' has dtype {arr.dtype}, "
                             "expected floating point")
        arr = np.ascontiguousarray(arr, dtype=storage_dtype("float32"))
        if not np.isfinite(arr).all():
            raise StoreError(f"{O_PROJ_FILE}: field 'o_proj' holds NaN/Inf, expected finite")
        return arr

    def _write_o_proj(self, o_proj: Any) -> dict[str, Any]:
        arr = self._check_o_proj(o_proj)
        final = self.path / O_PROJ_FILE
        tmp = tmp_path(final)
        tensors = {tensor_name("o_proj", layer): arr[layer] for layer in range(len(arr))}
        try:
            write_tensor_file(tmp, tensors, O_PROJ_FILE)
            entry = {"file": O_PROJ_FILE, "checksum": sha256_file(tmp),
                     "n_bytes": tmp.stat().st_size}
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.path)
        return entry

    # ------------------------------------------------------------------ sequences

    @property
    def sequence_ids(self) -> list[str]:
        """Ids of the finished sequences, in manifest order."""
        return self._table.column("sequence_id").to_pylist()

    def has(self, sequence_id: str) -> bool:
        """Whether ``sequence_id`` is finished (listed in the manifest)."""
        return sequence_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def sequence(self, sequence_id: str, **row: Any) -> SequenceWriter:
        """Start writing one sequence; use as a context manager.

        Parameters
        ----------
        sequence_id : str
            Unique id (any string; it is sanitized into a file name).
        **row
            Manifest fields (see ``docs/trace-format.md``) other than those the store derives
            (``model_id``, ``dtype``, ``schema_version``, ``file``, ``checksum``, ``n_bytes``).
            Fields may also be given later with :meth:`SequenceWriter.update`; all must be
            present when the block exits.

        Returns
        -------
        SequenceWriter
            Commits on normal exit of the ``with`` block, discards everything on an exception.
        """
        if self.closed:
            raise StoreError(f"{self.path}: TraceWriter is closed")
        if self._active is not None:
            raise StoreError(
                f"{self.path}: sequence {self._active.sequence_id!r} is still open; "
                "expected one sequence at a time"
            )
        check_sequence_id(sequence_id)
        if self.has(sequence_id):
            raise StoreError(f"{self.path / MANIFEST_FILE}: sequence {sequence_id!r} is already "
                             "stored; expected a new sequence_id (use has() to skip)")
        stem = safe_file_stem(sequence_id)
        rel = f"{SEQ_DIR}/{stem}{TENSOR_SUFFIX}"
        if rel.lower() in self._files:
            rel = f"{SEQ_DIR}/{safe_file_stem(sequence_id + chr(0))}{TENSOR_SUFFIX}"
            if rel.lower() in self._files:  # pragma: no cover - hash collision
                raise StoreError(f"{self.path}: file name {rel!r} is taken")
        self._active = SequenceWriter(self, sequence_id, rel, row)
        return self._active

    def _commit_row(self, row: dict[str, Any]) -> None:
        table = pa.concat_tables([self._table, row_table(row)])
        write_manifest(self.path, table)
        self._table = table
        self._ids.add(row["sequence_id"])
        self._files.add(row["file"].lower())
