"""SnapKV: attention of the observation window's queries, pooled along positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.policies.base import Score
from tracesim.policies.context import LayerTrace

__all__ = ["SnapKVScore", "pool1d"]


def pool1d(x: np.ndarray, kernel: int, kind: str) -> np.ndarray:
    """Same-length 1-D pooling (stride 1, window centred, edges use the available values)."""
    if kernel <= 1 or x.size == 0:
        return x.copy()
    half = kernel // 2
    n = x.size
    if kind == "avg":
        # Zero padding like torch's avg_pool1d(padding=k//2, count_include_pad=True).
        c = np.concatenate(([0.0], np.cumsum(x)))
        lo = np.clip(np.arange(n) - half, 0, n)
        hi = np.clip(np.arange(n) - half + kernel, 0, n)
        return (c[hi] - c[lo]) / kernel
    padded = np.concatenate((np.full(half, -np.inf), x, np.full(kernel - 1 - half, -np.inf)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel)
    return windows.max(axis=1)


@dataclass(frozen=True)
class SnapKVScore(Score):
    """Mean attention of the last ``window`` observation queries over the group, then pooled.

    Parameters
    ----------
    window : int, default 32
        Observation window: its queries score the prefix, its tokens are kept.
    kernel : int, default 5
        Pooling kernel (odd); 1 disables pooling.
    pooling : {"avg", "max"}
    question_aware : bool, default True
        True: the window is the ``question_window`` queries (the last prompt tokens, which
        include the question) and the whole prompt is compressed. False: the window is the
        ``context_window`` queries (the last tokens before the question) and only the context
        ``[0, question_start)`` is compressed; question tokens are always kept.

    Notes
    -----
    Attention is post-softmax mass (>= 0); pooling preserves non-negativity. If the store holds
    fewer than ``window`` queries of the role, all of them are used.
    """

    name: ClassVar[str] = "snapkv"
    transform: ClassVar[str] = "pooled attention mass (>= 0 as is)"

    window: int = 32
    kernel: int = 5
    pooling: str = "avg"
    question_aware: bool = True

    def validate(self) -> None:
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"SnapKVScore.kernel = {self.kernel}: expected an odd int >= 1")
        if self.pooling not in ("avg", "max"):
            raise ValueError(f"SnapKVScore.pooling = {self.pooling!r}: expected 'avg' or 'max'")
        if not isinstance(self.question_aware, bool):
            raise ValueError("SnapKVScore.question_aware must be a bool")

    @property
    def role(self) -> str:
        return "question_window" if self.question_aware else "context_window"

    def compress_end(self, trace: LayerTrace) -> int:
        return trace.prompt_length if self.question_aware else max(1, trace.question_start)

    def window_queries(self, trace: LayerTrace, end: int) -> np.ndarray:
        """Indices of the observation queries for an event at ``end``."""
        idx = trace.role_indices(self.role, before=end)
        if idx.size == 0:
            # Decode-time events (or stores without the role): the last stored queries before end.
            idx = trace.indices_before(end)
        return idx[-self.window:] if self.window > 0 else idx[-1:]

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        idx = self.window_queries(trace, end)
        if idx.size == 0:
            raise ValueError(f"snapkv: no stored query before position {end} in "
                             f"sequence {trace.sequence_id!r}")
        att = trace.group_attention(kv_head, idx)[:end]
        return pool1d(att, self.kernel, self.pooling)
