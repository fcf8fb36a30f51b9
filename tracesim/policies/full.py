"""No eviction: the full cache (the reference every other policy is measured against)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score

__all__ = ["FullScore"]


@dataclass(frozen=True)
class FullScore(Score):
    """Keeps every token (``pi = 1``); design, correction and budget are ignored."""

    name: ClassVar[str] = "full"
    evicts: ClassVar[bool] = False
    default_correction: ClassVar[str] = "none"
    transform: ClassVar[str] = "(none)"

    sinks: int = 0
    window: int = 0

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        return np.ones(end)
