"""The attention variant of each layer, read from ``model.json`` (all fields optional).

* ``layer_attention``: list (one per model layer) of ``{"kind": "full" | "sliding",
  "window": int | null}``; a sliding layer's query at position ``t`` attends ``(t - w, t]``.
* ``attn_logit_softcap``: float or null; logits ``c * tanh(scaling * q.k / c)`` (Gemma 2).
* ``sinks``: null, or a list (n_layers) of lists (n_heads) of float: learned per-head sink
  logits entering the softmax denominator with value zero (gpt-oss).

A store without them is full attention everywhere, unchanged. Indices are the STORED layers and
query heads (a subset store records only what it holds, docs/trace-format.md). The fields are
validated once, by :class:`~tracesim.store.format.ModelMeta` when ``model.json`` is read; this
module only gives each layer its view.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .format import ModelMeta

__all__ = ["LayerAttention", "layer_attention"]

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


def layer_attention(model: ModelMeta, layer: int) -> LayerAttention:
    """How stored ``layer`` attends, from the fields :class:`~tracesim.store.format.ModelMeta`
    has already validated (:mod:`tracesim.attention_rule`); full and plain when absent."""
    kind, window = "full", None
    if model.layer_attention is not None:
        entry = model.layer_attention[layer]
        kind, window = entry["kind"], entry["window"]
    sinks = (None if model.sinks is None
             else np.asarray(model.sinks[layer], dtype=np.float64))
    return LayerAttention(kind=kind, window=window, softcap=model.attn_logit_softcap,
                          sinks=sinks)

