"""SnapKV: attention of the observation window's queries, pooled along positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score

__all__ = ["WINDOW_SOURCES", "SnapKVScore", "pool1d", "positions_indices"]


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


WINDOW_SOURCES = ("last", "question")


def positions_indices(trace: LayerTrace, lo: int, hi: int, who: str) -> np.ndarray:
    """Indices of the stored queries at positions ``[lo, hi)``, whatever their role.

    Raises ``ValueError`` naming the sequence and the missing positions if any is not stored.
    """
    want = np.arange(max(0, lo), hi)
    idx = np.searchsorted(trace.query_positions, want)
    ok = idx < trace.query_positions.size
    ok[ok] = trace.query_positions[idx[ok]] == want[ok]
    if not ok.all():
        missing = want[~ok]
        raise ValueError(
            f"{who}: sequence {trace.sequence_id!r} does not store the queries at positions "
            f"[{max(0, lo)}, {hi}) ({missing.size} missing, first {int(missing[0])}); capture "
            f"with `tracesim capture --window {hi - max(0, lo)}` (or longer), lower `window`, "
            "or use window_source='question'")
    return idx


@dataclass(frozen=True)
class SnapKVScore(Score):
    """Mean attention of the observation window's queries over the group, then pooled.

    Parameters
    ----------
    window : int, default 32
        Observation window: its queries score the prefix, its tokens are kept.
    kernel : int, default 5
        Pooling kernel (odd); 1 disables pooling.
    pooling : {"avg", "max"}
    question_aware : bool, default True
        True: the whole prompt ``[0, prompt_length)`` is compressed and the window ends at the
        end of the prompt. False: only the context ``[0, question_start)`` is compressed, the
        window ends at ``question_start``, and question tokens are always kept.
    window_source : {"last", "question"}, default "last"
        ``"last"`` (SnapKV as published): the observation queries are those at the last
        ``window`` positions of the compressed range, ``[L - window, L)`` with ``L`` the
        prompt length (question-aware) or ``question_start`` (question-agnostic), whatever role
        they are stored under; every one of them must be stored (else ``ValueError``).
        ``"question"``: only the queries stored under the window's role (``question_window``,
        or ``context_window`` when question-agnostic), at most the last ``window`` of them; with
        fewer stored, all of them (on 1k-token passkey prompts the question-window role holds
        the 16-18 question tokens, not 32).
    refresh : bool, default False
        Under ``decode:K``, at every decode-time event ``tau`` the observation window slides:
        the last ``window`` queries among the one-shot window's queries and the stored decode
        queries at positions ``< tau``. Without refresh every event reuses the one-shot
        window's queries. No effect on the first event (one-shot compression).

    Notes
    -----
    Attention is post-softmax mass (>= 0); pooling preserves non-negativity.
    """

    name: ClassVar[str] = "snapkv"
    transform: ClassVar[str] = "pooled attention mass (>= 0 as is)"

    window: int = 32
    kernel: int = 5
    pooling: str = "avg"
    question_aware: bool = True
    window_source: str = "last"
    refresh: bool = False

    def validate(self) -> None:
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"SnapKVScore.kernel = {self.kernel}: expected an odd int >= 1")
        if self.pooling not in ("avg", "max"):
            raise ValueError(f"SnapKVScore.pooling = {self.pooling!r}: expected 'avg' or 'max'")
        if not isinstance(self.question_aware, bool):
            raise ValueError("SnapKVScore.question_aware must be a bool")
        if self.window_source not in WINDOW_SOURCES:
            raise ValueError(f"SnapKVScore.window_source = {self.window_source!r}: expected "
                             f"one of {list(WINDOW_SOURCES)}")
        if not isinstance(self.refresh, bool):
            raise ValueError(f"SnapKVScore.refresh = {self.refresh!r}: expected a bool")

    @property
    def role(self) -> str:
        return "question_window" if self.question_aware else "context_window"

    def compress_end(self, trace: LayerTrace) -> int:
        return trace.prompt_length if self.question_aware else max(1, trace.question_start)

    def prompt_window(self, trace: LayerTrace, end: int | None = None) -> np.ndarray:
        """Indices of the observation queries without refresh (see ``window_source``)."""
        L = self.compress_end(trace)
        if self.window_source == "last":
            return positions_indices(trace, L - max(self.window, 1), L,
                                     f"snapkv(window_source='last', window={self.window})")
        end = L if end is None else end
        idx = trace.role_indices(self.role, before=end)
        if idx.size == 0:
            # Stores without the role: the last stored queries before the event.
            idx = trace.indices_before(end)
        return idx[-self.window:] if self.window > 0 else idx[-1:]

    def window_queries(self, trace: LayerTrace, end: int) -> np.ndarray:
        """Indices of the observation queries for an event at ``end``."""
        idx = self.prompt_window(trace, end)
        if self.refresh and end > self.compress_end(trace):
            dec = trace.role_indices("decode", before=end)
            idx = np.union1d(idx, dec)
            idx = idx[-self.window:] if self.window > 0 else idx[-1:]
        return idx

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        idx = self.window_queries(trace, end)
        if idx.size == 0:
            raise ValueError(f"snapkv: no stored query before position {end} in "
                             f"sequence {trace.sequence_id!r}")
        att = trace.group_attention(kv_head, idx)[:end]
        return pool1d(att, self.kernel, self.pooling)
