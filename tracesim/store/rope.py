"""The RoPE fields of ``model.json``: one ``rope_theta`` / ``rope_scaling`` for the model, or
``layer_rope``, one per stored layer, for models whose layer types rotate differently (Gemma 3:
base 10 000 on its sliding layers, 1 000 000 on its full ones). Checked once, by
:class:`~tracesim.store.format.ModelMeta`; :meth:`ModelMeta.rope` gives a layer its RoPE."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["check_layer_rope", "check_rope_scaling", "check_rope_theta"]


def check_rope_theta(theta: Any, where: str) -> float | None:
    """A RoPE base: ``None`` or a finite float > 1 (else ValueError naming ``where``)."""
    if theta is None:
        return None
    if (not isinstance(theta, (int, float, np.integer, np.floating))
            or isinstance(theta, (bool, np.bool_)) or not math.isfinite(float(theta))
            or not float(theta) > 1.0):
        raise ValueError(f"field {where!r} is {theta!r}, expected null or a finite "
                         "float > 1")
    return float(theta)


def check_rope_scaling(rs: Any, where: str) -> dict[str, Any] | None:
    """A RoPE scaling dict: ``None`` or a string ``rope_type`` and JSON scalars."""
    if rs is None:
        return None
    ok = (isinstance(rs, dict) and 0 < len(rs) <= 32
          and isinstance(rs.get("rope_type", rs.get("type")), str)
          and all(isinstance(k, str) and len(k) <= 64 for k in rs)
          and all(v is None or isinstance(v, (bool, int, float, str))
                  and not (isinstance(v, str) and len(v) > 64)
                  and not (isinstance(v, float) and not math.isfinite(v))
                  for v in rs.values()))
    if not ok:
        raise ValueError(f"field {where!r} is {str(rs)[:80]}, expected null or an "
                         "object with a string 'rope_type' and JSON scalars")
    return dict(rs)


def check_layer_rope(value: Any, n_layers: int) -> list[dict[str, Any]] | None:
    """``layer_rope``: ``None`` or ``n_layers`` objects ``{"rope_theta", "rope_scaling"}``."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != n_layers:
        raise ValueError(f"field 'layer_rope' is {str(value)[:80]}, expected null "
                         f"or a list of n_layers = {n_layers} objects")
    out = []
    for i, entry in enumerate(value):
        if not isinstance(entry, dict) or sorted(entry) != ["rope_scaling", "rope_theta"] \
                or entry["rope_theta"] is None:
            raise ValueError(f"field 'layer_rope'[{i}] is {str(entry)[:80]}, "
                             "expected {'rope_theta': float > 1, 'rope_scaling': object}")
        where = f"layer_rope[{i}]"
        scaling = entry["rope_scaling"] or {"rope_type": "default"}
        out.append({"rope_theta": check_rope_theta(entry["rope_theta"], where + ".rope_theta"),
                    "rope_scaling": check_rope_scaling(scaling, where + ".rope_scaling")})
    return out
