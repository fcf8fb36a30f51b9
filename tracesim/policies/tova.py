"""TOVA: attention of the current (last) query, averaged over the GQA group's heads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score

__all__ = ["TOVAScore"]


@dataclass(frozen=True)
class TOVAScore(Score):
    """Attention of the last stored query before the event, averaged over the group's heads.

    One-shot: the last prompt query (position ``prompt_length - 1``); decode-time: the query of
    the step just before the event. TOVA averages over the heads that share one cache, which
    under GQA is the group of the KV head.
    """

    name: ClassVar[str] = "tova"
    transform: ClassVar[str] = "attention mass (>= 0 as is)"

    window: int = 0

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        idx = trace.indices_before(end)
        if idx.size == 0:
            raise ValueError(f"tova: no stored query before position {end}")
        return trace.group_attention(kv_head, idx[-1:])[:end]
