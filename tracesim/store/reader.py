"""Reading a trace store: :func:`open_store`, :class:`TraceStore`, :class:`TraceSequence`.

Everything is lazy and memory-mapped: opening a store reads ``model.json`` and the manifest;
a tensor is read (as a zero-copy, read-only numpy view) only when asked for, so memory stays
bounded by the (layer, head) tensors actually used, however long the context.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .attention import LayerAttention, layer_attention
from .format import (
    MANIFEST_FILE,
    O_PROJ_FILE,
    ModelMeta,
    StoreError,
    member_path,
    sha256_file,
)
from .manifest import NULLABLE, check_row, read_manifest
from .safe import member_file, read_model_json
from .tensorfile import TensorFile, sequence_layout, tensor_name


def _check_index(value: Any, size: int, what: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if not 0 <= value < size:
        raise IndexError(f"{what} {value} out of range [0, {size})")
    return int(value)


class TraceSequence:
    """One recorded sequence: its manifest row and lazily memory-mapped tensors.

    Attributes
    ----------
    sequence_id : str
    meta : dict
        The manifest row (plain Python values).
    n_positions : int
        Number of positions whose K/V are stored.
    n_query : int
        Number of recorded query positions.
    query_positions : numpy.ndarray
        ``(n_query,)`` int64, sorted positions of the recorded queries.
    query_roles : list of str
        Role of each query position (``context_window``, ``question_window``, ``decode``,
        ``all``).
    path : Path
        The tensor file.
    has_sinks : bool
        The model has learned sinks (``model.json`` ``sinks``): the h2o scores then sum to at
        most ``prompt_length`` (each sink keeps a share).

    Notes
    -----
    Returned arrays are read-only views into the memory-mapped file (no copy); copy them
    (``arr.copy()``) to modify. They stay valid while referenced, even after the store object
    is dropped.
    """

    def __init__(self, model: ModelMeta, root: Path, meta: dict[str, Any]) -> None:
        self.model = model
        self.meta = meta
        self.has_sinks = False
        self.sequence_id: str = meta["sequence_id"]
        label = f"{MANIFEST_FILE}: sequence {self.sequence_id!r}"
        self.path = member_path(root, meta["file"], label)
        self.root = root
        self.file: str = meta["file"]
        self.n_positions = int(meta["n_positions"])
        self.n_query = int(meta["n_query"])
        self._tensors: TensorFile | None = None

    def __repr__(self) -> str:
        return (f"TraceSequence({self.sequence_id!r}, n_positions={self.n_positions}, "
                f"n_query={self.n_query}, file={self.file!r})")

    @property
    def query_positions(self) -> np.ndarray:
        """``(n_query,)`` int64 positions of the recorded queries (sorted, unique)."""
        return np.asarray(self.meta["query_positions"], dtype=np.int64)

    @property
    def query_roles(self) -> list[str]:
        """Role of each recorded query position."""
        return list(self.meta["query_roles"])

    @property
    def token_ids(self) -> np.ndarray:
        """``(n_positions,)`` int64 token ids of the stored positions."""
        return np.asarray(self.meta["token_ids"], dtype=np.int64)

    def _file(self) -> TensorFile:
        if self._tensors is None:
            try:
                member_file(self.root, self.file)
            except FileNotFoundError:
                raise StoreError(f"{self.file}: file is missing (listed for sequence "
                                 f"{self.sequence_id!r} in {MANIFEST_FILE}), expected its tensor "
                                 "file") from None
            self._tensors = TensorFile(self.path, self.file)
        return self._tensors

    def data_bytes(self) -> int:
        """Bytes of tensor data the manifest row and ``model.json`` imply for this file."""
        m = self.model
        item = 2 if m.dtype == "float16" else 4
        per_layer = (2 * m.n_kv_heads * self.n_positions * m.head_dim * item
                     + 2 * m.n_heads * self.n_query * m.head_dim * item
                     + m.n_heads * self.n_positions * 4)
        return m.n_layers * per_layer

    def verify(self, checksum: bool = True) -> None:
        """Check this sequence before use; raise :class:`StoreError` naming file and field.

        Structure (always, no tensor byte is read): the manifest row's consistency (query
        positions in ``[0, n_positions)``, roles, prompt boundaries), model id and dtype, the
        file is a regular file inside the store whose size equals ``n_bytes`` and covers the
        declared shapes, and the tensor index matches the layout of ``model.json``. With
        ``checksum`` also the sha256 of the file bytes (reads the whole file once).
        """
        m = self.model
        row = self.meta
        label = f"{MANIFEST_FILE}: sequence {self.sequence_id!r}"
        nulls = [k for k, v in row.items() if v is None and k not in NULLABLE]
        if nulls:
            raise StoreError(f"{label}: field(s) {nulls} are null, expected values")
        problems = check_row(row, label)
        for field, expected in (("model_id", m.model_id), ("dtype", m.dtype)):
            if row.get(field) != expected:
                problems.append(f"{label}: field {field!r} is {row.get(field)!r}, expected "
                                f"{expected!r} (model.json)")
        if problems:
            raise StoreError("; ".join(problems[:5]))
        try:
            st = member_file(self.root, self.file)
        except FileNotFoundError:
            raise StoreError(f"{self.file}: file is missing (listed for sequence "
                             f"{self.sequence_id!r} in {MANIFEST_FILE}), expected its tensor "
                                 "file") from None
        if st.st_size != row["n_bytes"]:
            raise StoreError(f"{self.file}: file has {st.st_size} bytes, expected n_bytes = "
                             f"{row['n_bytes']} ({MANIFEST_FILE}; truncated or rewritten?)")
        need = self.data_bytes()
        if st.st_size < need:
            raise StoreError(f"{self.file}: file has {st.st_size} bytes, expected at least "
                             f"{need} for the shapes declared by model.json and "
                             f"{MANIFEST_FILE} (n_positions = {self.n_positions}, n_query = "
                             f"{self.n_query})")
        if checksum:
            digest = sha256_file(self.path)
            if digest != row["checksum"]:
                raise StoreError(f"{self.file}: field 'checksum' of the file bytes is "
                                 f"{digest}, expected {row['checksum']} ({MANIFEST_FILE}; "
                                 "corrupted or rewritten?)")
        tf = self._file()
        layout = sequence_layout(m, self.n_positions, self.n_query)
        if tf.n_batches != len(layout) or len(tf.index) != len(layout):
            raise StoreError(f"{self.file}: index has {len(tf.index)} tensors in "
                             f"{tf.n_batches} batches, expected {len(layout)} for this model")
        for name, shape, dtype, desc in layout:
            entry = tf.index.get(name)
            if entry is None or (tuple(entry["shape"]), entry["dtype"]) != (shape, dtype):
                raise StoreError(f"{self.file}: {desc} is indexed as {entry!r}, expected "
                                 f"shape {shape} {dtype}")

    def _read(self, kind: str, field: str, layer: int, head: int, n_heads: int,
              shape: tuple[int, ...], dtype: str) -> np.ndarray:
        m = self.model
        layer = _check_index(layer, m.n_layers, "layer")
        head_word = "kv head" if kind in ("k", "v") else "head"
        head = _check_index(head, n_heads, head_word)
        what = f"field {field!r} of layer {layer} {head_word} {head}"
        return self._file().read(tensor_name(kind, layer, head), shape, dtype, what)

    def keys(self, layer: int, kv_head: int) -> np.ndarray:
        """``(n_positions, head_dim)`` post-RoPE keys of one KV head, in the storage dtype."""
        m = self.model
        return self._read("k", "keys", layer, kv_head, m.n_kv_heads,
                          (self.n_positions, m.head_dim), m.dtype)

    def values(self, layer: int, kv_head: int) -> np.ndarray:
        """``(n_positions, head_dim)`` values of one KV head, in the storage dtype."""
        m = self.model
        return self._read("v", "values", layer, kv_head, m.n_kv_heads,
                          (self.n_positions, m.head_dim), m.dtype)

    def queries(self, layer: int, head: int) -> np.ndarray:
        """``(n_query, head_dim)`` post-RoPE queries of one query head at ``query_positions``."""
        m = self.model
        return self._read("q", "queries", layer, head, m.n_heads,
                          (self.n_query, m.head_dim), m.dtype)

    def outputs(self, layer: int, head: int) -> np.ndarray:
        """``(n_query, head_dim)`` full-cache attention outputs of one head, before o_proj."""
        m = self.model
        return self._read("o", "outputs", layer, head, m.n_heads,
                          (self.n_query, m.head_dim), m.dtype)

    def h2o_scores(self, layer: int, head: int) -> np.ndarray:
        """``(n_positions,)`` float32 post-softmax attention each key got from prefill queries.

        The invariants ``validate`` documents are enforced here too (>= 0, zero after the
        prompt, summing to ``prompt_length``): a checksum only proves the file is the one the
        manifest lists, and a re-signed store with forged scores would replay silently.
        """
        from tracesim.store.validate import check_h2o

        arr = self._read("h2o", "h2o", layer, head, self.model.n_heads,
                         (self.n_positions,), "float32")
        where = f"{self.file}: field 'h2o' of layer {int(layer)} head {int(head)}"
        problems = check_h2o(arr, where, int(self.meta["prompt_length"]), self.has_sinks)
        if problems:
            raise StoreError(problems[0])
        return arr

    def close(self) -> None:
        """Drop the file handle (arrays already returned stay valid)."""
        self._tensors = None


class TraceStore:
    """A trace store opened for reading; see :func:`open_store`.

    Attributes
    ----------
    path : Path
    model : ModelMeta
    manifest : pyarrow.Table
        One row per finished sequence (columns in ``docs/trace-format.md``).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise StoreError(f"{self.path}: not a directory, expected a trace store")
        self.model, self._model_json = read_model_json(self.path)
        self.manifest: pa.Table = read_manifest(self.path)
        ids = self.manifest.column("sequence_id").to_pylist()
        self._row_of = {sid: i for i, sid in enumerate(ids)}
        if len(self._row_of) != len(ids):
            raise StoreError(f"{self.path / MANIFEST_FILE}: field 'sequence_id' has duplicates, "
                             "expected unique ids")
        self._ids = ids
        self._o_proj: TensorFile | None = None
        #: What replays derive from this store's o_proj (its Gram blocks and QR factor), kept
        #: for the next replay of the same store object: the o_proj file is checked and mapped
        #: once, so they cannot change under it (:class:`tracesim.replay.engine.ReplaySetup`).
        self.gram_cache: dict = {}

    def __repr__(self) -> str:
        return f"TraceStore({str(self.path)!r}, {len(self)} sequences, {self.model.model_id!r})"

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def sequence_ids(self) -> list[str]:
        """Ids of the stored sequences, in manifest order."""
        return list(self._ids)

    def __contains__(self, sequence_id: object) -> bool:
        return sequence_id in self._row_of

    def __getitem__(self, sequence_id: str) -> TraceSequence:
        try:
            i = self._row_of[sequence_id]
        except KeyError:
            raise KeyError(f"{self.path}: no sequence {sequence_id!r}") from None
        meta = self.manifest.slice(i, 1).to_pylist()[0]
        seq = TraceSequence(self.model, self.path, meta)
        seq.has_sinks = self.model.sinks is not None
        return seq

    def __iter__(self) -> Iterator[TraceSequence]:
        for sequence_id in self._ids:
            yield self[sequence_id]

    @property
    def kept(self) -> dict[str, Any]:
        """Which model layers / heads the store holds (``model.json`` field ``kept``).

        ``layers[i]`` is the model layer stored as layer ``i``, ``kv_heads[g]`` and
        ``heads[h]`` the model heads stored as KV head ``g`` / query head ``h``. A store of the
        whole model (or written before the field existed) maps every index to itself.
        """
        kept = self._model_json.get("kept")
        if kept is not None:
            return dict(kept)
        m = self.model
        return {"layers": list(range(m.n_layers)), "kv_heads": list(range(m.n_kv_heads)),
                "heads": list(range(m.n_heads)), "model_n_layers": m.n_layers,
                "model_n_heads": m.n_heads, "model_n_kv_heads": m.n_kv_heads}

    def layer_attention(self, layer: int) -> LayerAttention:
        """How stored ``layer`` attends: sliding window, soft-cap, sinks (``model.json``'s
        optional fields, see :mod:`tracesim.store.attention`); full and plain when absent."""
        m = self.model
        layer = _check_index(layer, m.n_layers, "layer")
        # indexed by STORED layer and query head (docs/trace-format.md), as capture writes them
        return layer_attention(m, layer)

    @property
    def is_subset(self) -> bool:
        """Whether the store holds only some of the model's layers / KV heads."""
        return self._model_json.get("kept") is not None

    @property
    def has_o_proj(self) -> bool:
        """Whether the o_proj weights are stored."""
        return self._model_json.get("o_proj") is not None

    def o_proj(self, layer: int) -> np.ndarray | None:
        """``(hidden_size, n_heads * head_dim)`` float32 o_proj weight of ``layer``, or None.

        Zero-copy, read-only view of ``o_proj.arrow``; ``None`` if the store has no o_proj.
        """
        if not self.has_o_proj:
            return None
        m = self.model
        layer = _check_index(layer, m.n_layers, "layer")
        if self._o_proj is None:
            try:
                st = member_file(self.path, O_PROJ_FILE)
            except FileNotFoundError:
                raise StoreError(f"{O_PROJ_FILE}: file is missing, expected by field 'o_proj' "
                                 "of model.json") from None
            entry = self._model_json["o_proj"]
            if st.st_size != entry["n_bytes"]:
                raise StoreError(f"{O_PROJ_FILE}: file has {st.st_size} bytes, expected "
                                 f"n_bytes = {entry['n_bytes']} (model.json)")
            need = m.n_layers * m.hidden_size * m.n_heads * m.head_dim * 4
            if st.st_size < need:
                raise StoreError(f"{O_PROJ_FILE}: file has {st.st_size} bytes, expected at "
                                 f"least {need} for the shapes declared by model.json")
            digest = sha256_file(self.path / O_PROJ_FILE)
            if digest != entry["checksum"]:
                raise StoreError(f"{O_PROJ_FILE}: field 'checksum' of the file bytes is "
                                 f"{digest}, expected {entry['checksum']} (model.json; "
                                 "corrupted or rewritten?)")
            self._o_proj = TensorFile(self.path / O_PROJ_FILE, O_PROJ_FILE)
        return self._o_proj.read(tensor_name("o_proj", layer),
                                 (m.hidden_size, m.n_heads * m.head_dim), "float32",
                                 f"field 'o_proj' of layer {layer}")


def open_store(path: str | os.PathLike[str], *, require_rows: bool = False) -> TraceStore:
    """Open a trace store for reading.

    Parameters
    ----------
    path : str or Path
        Store directory.
    require_rows : bool
        Refuse a store whose manifest has no row. Every command that replays or simulates
        asks for this: an empty store would give an empty result that replaces earlier
        results with exit 0 (a capture in progress may legitimately have none yet).

    Returns
    -------
    TraceStore

    Raises
    ------
    StoreError
        If the directory, ``model.json`` or ``manifest.parquet`` is missing or invalid.
    """
    store = TraceStore(path)
    if require_rows and store.manifest.num_rows == 0:
        raise StoreError(f"{store.path / MANIFEST_FILE}: has 0 rows, expected at least one "
                         "finished sequence to replay")
    return store
