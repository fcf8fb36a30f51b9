"""KeyDiff (kvpress ``KeyDiffPress``): keep keys that differ from the average key direction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score

__all__ = ["KeyDiffScore"]


@dataclass(frozen=True)
class KeyDiffScore(Score):
    """``x_i = 1 - cos(k_i, a)`` with anchor ``a = mean_j k_j / ‖k_j‖`` over ``[0, end)``.

    kvpress scores ``-cos(k_i, a)``; ``1 - cos`` has the same order and lies in ``[0, 2]``, as
    designs need. Reads only the post-RoPE keys of the KV head at positions ``[0, end)`` (no
    query). The anchor is recomputed at every event over the keys that exist then.
    kvpress's block-wise iterative variant (``BlockPress``) is not reproduced.
    """

    name: ClassVar[str] = "keydiff"
    transform: ClassVar[str] = "1 - cos(k_i, mean normalized key) (in [0, 2])"

    window: int = 0

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        k = trace.keys[kv_head, :end]
        norms = np.maximum(np.linalg.norm(k, axis=1), 1e-12)
        anchor = (k / norms[:, None]).mean(axis=0)
        cos = (k @ anchor) / (norms * max(float(np.linalg.norm(anchor)), 1e-12))
        return np.clip(1.0 - cos, 0.0, 2.0)
