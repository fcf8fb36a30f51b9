"""StreamingLLM: position only — attention sinks plus the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score

__all__ = ["StreamingScore"]


@dataclass(frozen=True)
class StreamingScore(Score):
    """Recency score ``x_i = i + 1`` (linear in position).

    With the ``topk`` design this is StreamingLLM exactly (sinks + the most recent tokens up to
    the budget); with a randomized design recent tokens are proportionally more likely kept.
    ``window`` defaults to 0 because the score itself already prefers recent tokens.
    """

    name: ClassVar[str] = "streaming"
    transform: ClassVar[str] = "x_i = position + 1 (> 0)"

    window: int = 0

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        return np.arange(1, end + 1, dtype=np.float64)
