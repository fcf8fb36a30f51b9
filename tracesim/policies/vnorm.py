"""VaSE-like value-norm score: protect the largest ‖v‖ tokens, sample among the rest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score

__all__ = ["VNormScore"]


@dataclass(frozen=True)
class VNormScore(Score):
    """``x_i = ‖v_i‖`` (>= 0), with half of the tail budget take-all for the largest norms.

    ``top_fraction`` (default 0.5) of the tail budget goes, with ``pi = 1``, to the tokens with
    the largest value norms; the design spreads the rest over the remaining tail by ``‖v‖``
    (use ``bernoulli`` for a uniform spread).
    """

    name: ClassVar[str] = "vnorm"
    transform: ClassVar[str] = "|v| (>= 0 as is)"

    window: int = 32
    top_fraction: float = 0.5

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        return np.linalg.norm(trace.values[kv_head, :end], axis=1)
