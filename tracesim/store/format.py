"""Constants, errors, model metadata and file-system helpers of the trace store format.

The on-disk format is documented in ``docs/trace-format.md``; this module holds the pieces that
every other store module shares: :data:`SCHEMA_VERSION`, :class:`StoreError`, :class:`ModelMeta`,
file names, sequence-id sanitizing and the store-file checksum.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from tracesim import attention_rule, digests
from tracesim.store.rope import check_layer_rope, check_rope_scaling, check_rope_theta

SCHEMA_VERSION = 1
"""Version of the on-disk layout; bumped on any incompatible change."""

STORE_FORMAT = "tracesim-trace-store"
MODEL_FILE = "model.json"
MANIFEST_FILE = "manifest.parquet"
O_PROJ_FILE = "o_proj.arrow"
SEQ_DIR = "seq"
TENSOR_SUFFIX = ".arrow"
LOCK_FILE = ".lock"
STORAGE_DTYPES = ("float16", "float32")
QUERY_ROLES = ("context_window", "question_window", "decode", "all")

#: Upper bounds of model.json sizes (far above any real model; they keep an untrusted store from
#: declaring layouts that cannot be allocated): field -> largest value.
MODEL_LIMITS = {"n_layers": 4096, "n_heads": 4096, "n_kv_heads": 4096, "head_dim": 16384,
                "hidden_size": 1 << 20}
#: Largest number of tensors one sequence file may declare (n_layers * (2 n_kv + 3 n_heads)).
MAX_TENSORS = 1 << 20
#: model.json fields a store may lack (the RoPE settings, recorded since they were captured; the
#: attention variants of docs/trace-format.md, absent for plain full-attention models).
OPTIONAL_MODEL_FIELDS = ("rope_theta", "rope_scaling", "layer_attention", "attn_logit_softcap",
                         "sinks", "layer_rope")
#: ``scaling`` must lie in (0, MAX_SCALING] (head_dim ** -0.5 is below 1 for every model).
MAX_SCALING = 16.0

_STEM_MAX = 100
# Unsafe characters, and a leading dot (no hidden files): both become "_".
_UNSAFE_OR_LEADING_DOT = re.compile(r"[^A-Za-z0-9._-]|^\.")
_SEQ_FILE = re.compile(r"seq/[A-Za-z0-9_-][A-Za-z0-9._-]*\.arrow")


class StoreError(ValueError):
    """A trace store or a record written to it is invalid.

    Messages name the file, the field and the expected value, e.g.
    ``seq/abc.arrow: field 'keys' of layer 3 has shape (3, 100, 64), expected (3, 101, 64)``.
    """


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@dataclass(frozen=True)
class ModelMeta:
    """Shape and storage facts of the traced model, stored once per store in ``model.json``.

    Attributes
    ----------
    model_id : str
        Model name, e.g. ``"smollm2-135m-instruct"``.
    architecture : str
        Hugging Face architecture, e.g. ``"LlamaForCausalLM"``.
    n_layers, n_heads, n_kv_heads, head_dim, hidden_size : int
        Positive sizes. Query head ``h`` uses KV head ``h // (n_heads // n_kv_heads)``.
    scaling : float
        Softmax scale of the model (usually ``head_dim ** -0.5``).
    dtype : str
        Storage dtype of K/V/Q/O tensors, ``"float16"`` or ``"float32"``.
    rope_theta : float, optional
        RoPE base of the model (Hugging Face ``rope_theta``); ``None`` in stores captured before
        it was recorded (scores that undo RoPE then refuse).
    rope_scaling : dict, optional
        RoPE scaling of the model: Hugging Face's ``rope_scaling`` (``rope_type`` and its
        factors, JSON scalars), ``{"rope_type": "default"}`` for none; ``None`` when not
        recorded.
    layer_attention : list of dict, optional
        Per stored layer ``{"kind": "full" | "sliding", "window": int | None}``; ``None``: every
        layer full (``tracesim.attention_rule``).
    attn_logit_softcap : float, optional
        Attention-logit soft-cap ``c`` (logits ``c * tanh(s / c)``); ``None``: none.
    sinks : list of list of float, optional
        Per stored layer and stored query head, the learned sink logit; ``None``: no sinks.
    layer_rope : list of dict, optional
        Per stored layer ``{"rope_theta": float, "rope_scaling": dict}``, for models whose
        layer types rotate differently (Gemma 3: base 10 000 on sliding layers, 1 000 000 on
        full ones); ``rope_theta`` and ``rope_scaling`` are then ``None``. ``None``: one RoPE
        for every layer (the fields above).
        The optional fields are written to ``model.json`` only when set.

    Raises
    ------
    StoreError
        If a field has the wrong type or value.
    """

    model_id: str
    architecture: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    scaling: float
    dtype: str
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    layer_attention: list[dict[str, Any]] | None = None
    attn_logit_softcap: float | None = None
    sinks: list[list[float]] | None = None
    layer_rope: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        for name in ("model_id", "architecture"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise StoreError(
                    f"ModelMeta: field {name!r} is {value!r}, expected a non-empty str"
                )
        for name in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_size"):
            value = getattr(self, name)
            hi = MODEL_LIMITS[name]
            if not _is_int(value) or not 0 < value <= hi:
                raise StoreError(f"ModelMeta: field {name!r} is {value!r}, expected a positive "
                                 f"int <= {hi}")
            object.__setattr__(self, name, int(value))
        n_tensors = self.n_layers * (2 * self.n_kv_heads + 3 * self.n_heads)
        if n_tensors > MAX_TENSORS:
            raise StoreError(f"ModelMeta: fields 'n_layers' x (2 n_kv_heads + 3 n_heads) = "
                             f"{n_tensors} tensors per sequence, expected at most {MAX_TENSORS}")
        if self.n_heads % self.n_kv_heads:
            raise StoreError(
                f"ModelMeta: field 'n_heads' is {self.n_heads}, expected a multiple of "
                f"n_kv_heads = {self.n_kv_heads}"
            )
        scaling = self.scaling
        if (
            not isinstance(scaling, (int, float, np.integer, np.floating))
            or isinstance(scaling, (bool, np.bool_))
            or not math.isfinite(float(scaling))
            or not 0 < float(scaling) <= MAX_SCALING
        ):
            raise StoreError(f"ModelMeta: field 'scaling' is {scaling!r}, expected a float in "
                             f"(0, {MAX_SCALING:g}]")
        object.__setattr__(self, "scaling", float(scaling))
        if self.dtype not in STORAGE_DTYPES:
            raise StoreError(
                f"ModelMeta: field 'dtype' is {self.dtype!r}, expected one of {STORAGE_DTYPES}"
            )
        try:
            ropes = dict(rope_theta=check_rope_theta(self.rope_theta, "rope_theta"),
                         rope_scaling=check_rope_scaling(self.rope_scaling, "rope_scaling"),
                         layer_rope=check_layer_rope(self.layer_rope, self.n_layers))
        except ValueError as exc:
            raise StoreError(f"ModelMeta: {exc}") from None
        for name, value in ropes.items():
            object.__setattr__(self, name, value)
        try:
            variants = dict(
                layer_attention=attention_rule.check_layer_attention(self.layer_attention,
                                                                     self.n_layers),
                attn_logit_softcap=attention_rule.check_softcap(self.attn_logit_softcap),
                sinks=attention_rule.check_sinks(self.sinks, self.n_layers, self.n_heads))
        except ValueError as exc:
            raise StoreError(f"ModelMeta: {exc}") from None
        for name, value in variants.items():
            object.__setattr__(self, name, value)

    def __hash__(self) -> int:  # rope_scaling is a dict, layer_attention and sinks lists
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def rope(self, layer: int) -> dict[str, Any] | None:
        """RoPE of stored ``layer``: ``{"rope_theta", "rope_scaling"}`` (from ``layer_rope`` when
        the model records one per layer), or ``None`` when not recorded."""
        if self.layer_rope is not None:
            entry = self.layer_rope[layer]
            return {"rope_theta": entry["rope_theta"],
                    "rope_scaling": dict(entry["rope_scaling"])}
        if self.rope_theta is None:
            return None
        return {"rope_theta": self.rope_theta, "rope_scaling": dict(self.rope_scaling or {})}

    @property
    def group_size(self) -> int:
        """Number of query heads sharing one KV head."""
        return self.n_heads // self.n_kv_heads

    def kv_head(self, head: int) -> int:
        """KV head used by query head ``head``."""
        return head // self.group_size

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of the fields (the optional ones only when set)."""
        d = asdict(self)
        for name in OPTIONAL_MODEL_FIELDS:
            if d[name] is None:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, data: Any, label: str = MODEL_FILE) -> ModelMeta:
        """Build from a dict holding the fields (extra keys are ignored; the optional RoPE
        fields may be missing, as in stores written before they were recorded).

        Raises
        ------
        StoreError
            Naming ``label`` and the missing or invalid field.
        """
        if not isinstance(data, dict):
            raise StoreError(f"{label}: expected a JSON object, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data and n not in OPTIONAL_MODEL_FIELDS]
        if missing:
            raise StoreError(f"{label}: missing field(s) {missing}")
        try:
            return cls(**{n: data[n] for n in names if n in data})
        except StoreError as exc:
            raise StoreError(f"{label}: {str(exc).removeprefix('ModelMeta: ')}") from None


def storage_dtype(name: str) -> np.dtype:
    """Little-endian numpy dtype of a storage dtype name (``"float16"``/``"float32"``)."""
    return np.dtype({"float16": "<f2", "float32": "<f4"}[name])


# --------------------------------------------------------------------------- names and paths


def check_sequence_id(sequence_id: Any) -> str:
    """Return ``sequence_id`` if usable, else raise :class:`StoreError`.

    Any non-empty string without NUL is accepted, except path-traversal attempts (a ``..``
    component or an absolute path): those are refused rather than silently renamed.
    """
    if not isinstance(sequence_id, str) or not sequence_id:
        raise StoreError(f"field 'sequence_id' is {sequence_id!r}, expected a non-empty str")
    if "\x00" in sequence_id or len(sequence_id) > 1024:
        raise StoreError(
            f"field 'sequence_id' {sequence_id[:80]!r}: expected no NUL and at most 1024 chars"
        )
    parts = re.split(r"[/\\]", sequence_id)
    if ".." in parts or sequence_id[0] in "/\\" or re.match(r"^[A-Za-z]:", sequence_id):
        raise StoreError(
            f"field 'sequence_id' {sequence_id!r}: path traversal is not allowed "
            "(expected no '..' component and no absolute path)"
        )
    return sequence_id


def safe_file_stem(sequence_id: str) -> str:
    """File stem for ``sequence_id``: only ``[A-Za-z0-9._-]``, no leading dot, <= 113 chars.

    Ids that are already safe map to themselves; others are sanitized and get a short hash of
    the original id appended, so that two different ids cannot share a file.
    """
    return digests.safe_file_stem(sequence_id, max_chars=_STEM_MAX, digest_chars=12,
                                     unsafe=_UNSAFE_OR_LEADING_DOT)


def member_path(root: Path, rel: Any, label: str) -> Path:
    """Resolve a manifest ``file`` entry safely inside the store ``root``.

    Raises
    ------
    StoreError
        If ``rel`` is not of the form ``seq/<safe-name>.arrow`` or escapes ``root``.
    """
    if not isinstance(rel, str) or not _SEQ_FILE.fullmatch(rel):
        raise StoreError(
            f"{label}: field 'file' is {rel!r}, expected 'seq/<name>.arrow' with a safe name"
        )
    path = root / rel
    try:
        inside = path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python < 3.13)
        raise StoreError(f"{label}: field 'file' {rel!r} is a symlink loop, expected a regular "
                         "file inside the store") from None
    if not inside:
        raise StoreError(f"{label}: field 'file' {rel!r} resolves outside the store, expected "
                         "a file inside the store")
    return path


# --------------------------------------------------------------------------- files


def sha256_file(path: Path) -> str:
    """``"sha256:<hex>"`` of the bytes of a store file (:func:`tracesim.digests.sha256_file`:
    a FIFO, device or /proc file is refused with a :class:`StoreError`; no size limit)."""
    return digests.sha256_file(path, "store file", error=StoreError)


# --------------------------------------------------------------------------- model.json


def kept_entry(layers: list[int], kv_heads: list[int], model_n_layers: int,
               model_n_heads: int, model_n_kv_heads: int) -> dict[str, Any]:
    """The ``kept`` entry of ``model.json`` for a store holding a subset of layers / KV heads.

    ``layers[i]`` is the model layer stored as layer ``i``; ``kv_heads[g]`` the model KV head
    stored as KV head ``g`` (with its whole GQA group of query heads, listed in ``heads``).
    """
    group = model_n_heads // model_n_kv_heads
    return {"layers": [int(x) for x in layers], "kv_heads": [int(x) for x in kv_heads],
            "heads": [g * group + j for g in kv_heads for j in range(group)],
            "model_n_layers": int(model_n_layers), "model_n_heads": int(model_n_heads),
            "model_n_kv_heads": int(model_n_kv_heads)}


def check_kept(kept: Any, model: ModelMeta) -> list[str]:
    """Problems of a ``kept`` entry against the stored model shape (empty if fine or null)."""
    if kept is None:
        return []
    label = f"{MODEL_FILE}: field 'kept'"
    keys = ("layers", "kv_heads", "heads", "model_n_layers", "model_n_heads",
            "model_n_kv_heads")
    if not isinstance(kept, dict) or sorted(kept) != sorted(keys):
        return [f"{label} is {kept!r}, expected null or an object with keys {list(keys)}"]
    sizes = [kept[k] for k in keys[3:]]
    if not all(_is_int(v) and v > 0 for v in sizes):
        return [f"{label}: model_n_* are {sizes}, expected positive ints"]
    lists = [kept[k] for k in keys[:3]]
    if not all(isinstance(v, list) and all(_is_int(x) for x in v) for v in lists):
        return [f"{label}: layers/kv_heads/heads must be lists of ints"]
    try:
        want = kept_entry(kept["layers"], kept["kv_heads"], *sizes)
    except ZeroDivisionError:
        return [f"{label}: model_n_kv_heads is 0, expected > 0"]
    problems = []
    for name, n, limit in (("layers", model.n_layers, kept["model_n_layers"]),
                           ("kv_heads", model.n_kv_heads, kept["model_n_kv_heads"])):
        v = kept[name]
        if len(v) != n or v != sorted(set(v)) or (v and (v[0] < 0 or v[-1] >= limit)):
            problems.append(f"{label}.{name} is {v}, expected {n} increasing indices in "
                            f"[0, {limit})")
    if kept["heads"] != want["heads"] or len(kept["heads"]) != model.n_heads:
        problems.append(f"{label}.heads is {kept['heads']}, expected {want['heads']} "
                        f"(the GQA groups of kv_heads, n_heads = {model.n_heads})")
    return problems


def model_json_bytes(model: ModelMeta, o_proj: dict[str, Any] | None,
                     kept: dict[str, Any] | None = None) -> bytes:
    """Serialized ``model.json``: the ModelMeta fields, schema version, the o_proj entry and,
    for stores of a subset of layers / heads, the ``kept`` entry."""
    doc = {"format": STORE_FORMAT, "schema_version": SCHEMA_VERSION, **model.to_dict()}
    doc["o_proj"] = o_proj
    if kept is not None:
        doc["kept"] = kept
    return (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode()


def check_model_doc(raw: dict[str, Any]) -> tuple[ModelMeta | None, list[str]]:
    """Check a parsed ``model.json`` object: schema version, ``o_proj`` entry, model fields and
    ``kept`` entry; return ``(model or None, problems)`` (reading it is
    :func:`tracesim.store.safe.parse_model_json`)."""
    problems = []
    version = raw.get("schema_version")
    if version != SCHEMA_VERSION:
        problems.append(
            f"{MODEL_FILE}: field 'schema_version' is {version!r}, expected {SCHEMA_VERSION}"
        )
    o_proj = raw.get("o_proj")
    if o_proj is not None and not (
        isinstance(o_proj, dict)
        and o_proj.get("file") == O_PROJ_FILE
        and isinstance(o_proj.get("checksum"), str)
        and _is_int(o_proj.get("n_bytes"))
    ):
        problems.append(
            f"{MODEL_FILE}: field 'o_proj' is {o_proj!r}, expected null or "
            f"{{'file': '{O_PROJ_FILE}', 'checksum': 'sha256:...', 'n_bytes': int}}"
        )
    try:
        model = ModelMeta.from_dict(raw)
    except StoreError as exc:
        return None, [*problems, str(exc)]
    return model, problems + check_kept(raw.get("kept"), model)
