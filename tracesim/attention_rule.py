"""The attention rule a trace store records: windows, soft-cap and sinks, in float64 numpy.

A store's ``model.json`` may carry three optional fields (``docs/trace-format.md``, "Attention
variants"): ``layer_attention`` (per stored layer, ``full`` or ``sliding`` with a window),
``attn_logit_softcap`` (Gemma 2) and ``sinks`` (gpt-oss's learned per-head sink logits). This
module checks those fields and holds :func:`attention_outputs`, the reference that recomputes a
layer's attention outputs from its stored Q/K/V under them. It imports only numpy, so the store,
the estimators and the tests can all use it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

#: Attention kinds of ``layer_attention`` entries.
ATTENTION_KINDS = ("full", "sliding")
#: Largest window accepted (far above any real model; keeps an untrusted store bounded).
MAX_WINDOW = 1 << 31


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value: Any) -> bool:
    return (isinstance(value, (int, float, np.integer, np.floating))
            and not isinstance(value, (bool, np.bool_)) and math.isfinite(float(value)))


def check_layer_attention(value: Any, n_layers: int) -> list[dict[str, Any]] | None:
    """Normalized ``layer_attention`` (``None`` stays ``None``: every layer full).

    Raises
    ------
    ValueError
        Naming the entry and the expected value.
    """
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != n_layers:
        raise ValueError(f"field 'layer_attention' is {str(value)[:80]}, expected null or a list "
                         f"of n_layers = {n_layers} entries")
    out = []
    for i, entry in enumerate(value):
        ok = isinstance(entry, dict) and sorted(entry) == ["kind", "window"]
        kind = entry.get("kind") if ok else None
        window = entry.get("window") if ok else None
        if kind == "full" and window is None:
            out.append({"kind": "full", "window": None})
        elif kind == "sliding" and _is_int(window) and 1 <= window <= MAX_WINDOW:
            out.append({"kind": "sliding", "window": int(window)})
        else:
            raise ValueError(f"field 'layer_attention'[{i}] is {str(entry)[:80]}, expected "
                             "{'kind': 'full', 'window': null} or {'kind': 'sliding', "
                             "'window': int >= 1}")
    return out


def check_softcap(value: Any) -> float | None:
    """Normalized ``attn_logit_softcap``: ``None`` or a finite float > 0 (else ValueError)."""
    if value is None:
        return None
    if not _is_real(value) or not float(value) > 0:
        raise ValueError(f"field 'attn_logit_softcap' is {value!r}, expected null or a finite "
                         "float > 0")
    return float(value)


def check_sinks(value: Any, n_layers: int, n_heads: int) -> list[list[float]] | None:
    """Normalized ``sinks``: ``None`` or ``n_layers`` lists of ``n_heads`` finite floats."""
    if value is None:
        return None
    ok = (isinstance(value, (list, tuple)) and len(value) == n_layers
          and all(isinstance(row, (list, tuple)) and len(row) == n_heads
                  and all(_is_real(x) for x in row) for row in value))
    if not ok:
        raise ValueError(f"field 'sinks' is {str(value)[:80]}, expected null or n_layers = "
                         f"{n_layers} lists of n_heads = {n_heads} finite floats")
    return [[float(x) for x in row] for row in value]


def layer_window(layer_attention: list[dict[str, Any]] | None, layer: int) -> int | None:
    """The window of stored layer ``layer`` (``None``: full attention)."""
    if layer_attention is None:
        return None
    return layer_attention[layer]["window"]


def population_start(position: np.ndarray | int, window: int | None) -> np.ndarray | int:
    """First attended position of a query at ``position``: 0, or ``position - window + 1``.

    Hugging Face's ``sliding_window`` overlay keeps ``kv_idx > q_idx - window`` on top of the
    causal ``kv_idx <= q_idx``, so a sliding query sees ``(t - window, t]``.
    """
    if window is None:
        return np.zeros_like(position) if isinstance(position, np.ndarray) else 0
    return np.maximum(np.asarray(position) - window + 1, 0) if isinstance(
        position, np.ndarray) else max(0, int(position) - window + 1)


def attention_outputs(
    queries: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    positions: np.ndarray,
    scaling: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Attention outputs of one layer recomputed in float64 under the recorded rule.

    Parameters
    ----------
    queries : np.ndarray
        ``(n_heads, n_query, head_dim)`` post-RoPE queries at ``positions``.
    keys, values : np.ndarray
        ``(n_kv_heads, n_positions, head_dim)``; query head ``h`` uses KV head
        ``h // (n_heads // n_kv_heads)``.
    positions : np.ndarray
        ``(n_query,)`` absolute query positions.
    scaling : float
        The model's softmax scale (logits ``s = scaling * q . k``).
    window : int, optional
        Sliding window: a query at ``t`` attends ``(t - window, t]``; ``None``: ``[0, t]``.
    softcap : float, optional
        Logits become ``softcap * tanh(s / softcap)`` (after scaling, before the softmax).
    sinks : np.ndarray, optional
        ``(n_heads,)`` sink logits entering each head's softmax denominator with zero value.

    Returns
    -------
    np.ndarray
        ``(n_heads, n_query, head_dim)`` float64.
    """
    q = np.asarray(queries, np.float64)
    k = np.asarray(keys, np.float64)
    v = np.asarray(values, np.float64)
    pos = np.asarray(positions, np.int64)
    n_heads, n_query, head_dim = q.shape
    group = n_heads // k.shape[0]
    out = np.zeros((n_heads, n_query, head_dim))
    for h in range(n_heads):
        kh, vh = k[h // group], v[h // group]
        for i, t in enumerate(pos):
            lo = population_start(int(t), window)
            s = scaling * (kh[lo:t + 1] @ q[h, i])
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            top = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            w = np.exp(s - top)
            denom = w.sum() + (0.0 if sinks is None else math.exp(float(sinks[h]) - top))
            out[h, i] = (w / denom) @ vh[lo:t + 1]
    return out
