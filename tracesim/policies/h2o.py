"""H2O: heavy hitters by accumulated attention, plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score

__all__ = ["H2OScore", "accumulated_attention"]


def accumulated_attention(trace: LayerTrace, kv_head: int, end: int,
                          normalize: bool) -> np.ndarray:
    """Attention each key in ``[0, end)`` received, summed over the group's heads.

    Prefill queries come from the store's ``h2o`` statistics (all prefill queries, which the
    store cannot otherwise recompute); decode queries at positions in ``[prompt_length, end)``
    are added from the stored decode queries' full-cache attention (an open-loop approximation:
    the replay never re-runs the model, so decode queries are those of the full-cache run).
    ``normalize`` divides by the number of queries that saw each key.
    """
    acc = np.zeros(end)
    pl = trace.prompt_length
    heads = trace.group(kv_head)
    for h in heads:
        acc += trace.h2o[h, :end]
    decode = trace.role_indices("decode", before=end)
    decode = decode[trace.query_positions[decode] >= pl]
    for h in heads:
        for i in decode:
            acc += trace.attention(h, int(i))[:end]
    if normalize:
        pos = np.arange(end)
        # Prefill queries at positions >= i saw key i, plus the stored decode queries.
        dp = np.sort(trace.query_positions[decode])
        seen = np.maximum(pl - pos, 0) + (dp.size - np.searchsorted(dp, pos, side="left"))
        acc = acc / np.maximum(seen, 1)
    return acc / len(heads)


@dataclass(frozen=True)
class H2OScore(Score):
    """Accumulated post-softmax attention (already >= 0; no transform needed).

    Parameters
    ----------
    normalize : bool, default False
        Divide by the number of queries that saw the key (removes the bias towards early tokens).
    """

    name: ClassVar[str] = "h2o"
    transform: ClassVar[str] = "accumulated attention mass (>= 0 as is)"

    window: int = 32
    normalize: bool = False

    def validate(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ValueError(f"H2OScore.normalize = {self.normalize!r}: expected a bool")

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        return accumulated_attention(trace, kv_head, end, self.normalize)
