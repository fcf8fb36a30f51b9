"""The attention variant of each layer, read from ``model.json`` (all fields optional).

* ``layer_attention``: list (one per model layer) of ``{"kind": "full" | "sliding",
  "window": int | null}``; a sliding layer's query at position ``t`` attends ``(t - w, t]``.
* ``attn_logit_softcap``: float or null; logits ``c * tanh(scaling * q.k / c)`` (Gemma 2).
* ``sinks``: null, or a list (n_layers) of lists (n_heads) of float: learned per-head sink
  logits entering the softmax denominator with value zero (gpt-oss).

A store without them is full attention everywhere, unchanged. Indices are the STORED layers and
query heads (a subset store records only what it holds, docs/trace-format.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .format import MODEL_FILE, StoreError

__all__ = ["LayerAttention", "layer_attention"]

ATTENTION_KINDS = ("full", "sliding")


@dataclass(frozen=True)
class LayerAttention:
    """How one stored layer attends.

    Attributes
    ----------
    kind : str
        ``"full"`` or ``"sliding"``.
    window : int or None
        The sliding window ``w`` (positions ``(t - w, t]``); ``None`` for a full layer.
    softcap : float or None
        Attention-logit soft-cap ``c``; ``None`` for none.
    sinks : ndarray of float64, shape (n_heads,), or None
        Sink logits of the stored query heads; ``None`` for none.
    """

    kind: str = "full"
    window: int | None = None
    softcap: float | None = None
    sinks: np.ndarray | None = None


def _number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(float(value)))


def layer_attention(model_json: dict[str, Any], layer: int, heads: list[int],
                    n_layers: int, n_heads: int) -> LayerAttention:
    """Parse the attention fields of ``model_json`` for one stored layer.

    Parameters
    ----------
    model_json : dict
        The parsed ``model.json``.
    layer : int
        The stored layer index.
    heads : list of int
        The stored query heads whose sinks to read (all of them: ``range(n_heads)``).
    n_layers, n_heads : int
        The stored layer and query-head counts (the lists' lengths).

    Raises
    ------
    StoreError
        Naming ``model.json``, the field and the expected value.
    """
    kind, window = "full", None
    spec = model_json.get("layer_attention")
    if spec is not None:
        if not isinstance(spec, list) or len(spec) != n_layers:
            raise StoreError(f"{MODEL_FILE}: field 'layer_attention' is not a list of "
                             f"{n_layers} entries, expected one {{kind, window}} per layer")
        entry = spec[layer]
        kind = entry.get("kind") if isinstance(entry, dict) else None
        window = entry.get("window") if isinstance(entry, dict) else None
        if kind not in ATTENTION_KINDS:
            raise StoreError(f"{MODEL_FILE}: field 'layer_attention[{layer}].kind' is "
                             f"{kind!r}, expected one of {ATTENTION_KINDS}")
        if kind == "sliding":
            if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                raise StoreError(f"{MODEL_FILE}: field 'layer_attention[{layer}].window' "
                                 f"is {window!r}, expected an int >= 1 for a sliding layer")
        elif window is not None:
            raise StoreError(f"{MODEL_FILE}: field 'layer_attention[{layer}].window' is "
                             f"{window!r}, expected null for a full layer")
    softcap = model_json.get("attn_logit_softcap")
    if softcap is not None:
        if not _number(softcap) or not float(softcap) > 0:
            raise StoreError(f"{MODEL_FILE}: field 'attn_logit_softcap' is {softcap!r}, "
                             "expected null or a finite float > 0")
        softcap = float(softcap)
    sinks = model_json.get("sinks")
    sink_row = None
    if sinks is not None:
        ok = (isinstance(sinks, list) and len(sinks) == n_layers
              and all(isinstance(r, list) and len(r) == n_heads and all(_number(x) for x in r)
                      for r in sinks))
        if not ok:
            raise StoreError(f"{MODEL_FILE}: field 'sinks' is not a list of {n_layers} lists of "
                             f"{n_heads} finite floats, expected null or one sink logit per "
                             "layer and query head")
        sink_row = np.asarray([float(sinks[layer][h]) for h in heads], dtype=np.float64)
    return LayerAttention(kind=kind, window=window, softcap=softcap, sinks=sink_row)


def refuse_attention_variants(store: Any, layers: Any, consumer: str) -> None:
    """Refuse, before any work, stored layers with a sliding window, a soft-cap or sinks, for a
    consumer that does not model them yet (naming the layer, the variant and the field).

    Raises
    ------
    StoreError
    """
    for layer in (range(len(store.kept["layers"])) if layers is None else layers):
        attn = store.layer_attention(int(layer))
        what = [name for name, on in (
            (f"a sliding window of {attn.window} (field 'layer_attention')", attn.window),
            (f"a logit soft-cap of {attn.softcap} (field 'attn_logit_softcap')", attn.softcap),
            ("learned sinks (field 'sinks')", attn.sinks is not None)) if on]
        if what:
            raise StoreError(f"{MODEL_FILE}: layer {int(layer)} has {' and '.join(what)}; "
                             f"{consumer} does not model this attention variant yet, expected "
                             "full attention without soft-cap or sinks (replay, sweep and "
                             "report do model it)")
