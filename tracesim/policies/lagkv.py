"""LagKV (kvpress ``LagKVPress``): score each partition of tokens against the next one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score

__all__ = ["LagKVScore", "lag_states_score"]


def lag_states_score(x: np.ndarray) -> np.ndarray:
    """Per-token scores of partitions ``(n_part, lag, d)`` against their successors.

    For partition ``p`` (all but the last), each feature is min-max scaled with the minimum and
    maximum over the tokens of partition ``p + 1``; the token's score is the standard deviation
    (ddof = 1) of its scaled features, softmaxed over the partition. Returns
    ``(n_part - 1, lag)``.
    """
    ref, cur = x[1:], x[:-1]
    lo = ref.min(axis=1, keepdims=True)
    hi = ref.max(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = (cur - lo) / (hi - lo)
    s = scaled.std(axis=2, ddof=1)
    s = np.where(np.isfinite(s), s, 0.0)
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@dataclass(frozen=True)
class LagKVScore(Score):
    """Lag-relative key/value statistics, ranked within each partition of ``lag_size`` tokens.

    Positions ``[sinks, end)`` are cut into partitions of ``lag_size``; every partition but the
    last full one (plus the remainder) is scored with the next partition as reference, on keys
    and on values (:func:`lag_states_score`), the two are averaged and, unless
    ``cross_scoring``, replaced by their rank within the partition divided by ``lag_size``
    (``0 .. (lag-1)/lag``). Sinks and the last partition score 1. When ``end < sinks +
    2 lag_size`` kvpress falls back to a linear ramp ``(i - sinks) / (end - sinks)``, as here.

    Reads only the post-RoPE keys and the values of positions ``[0, end)`` (no query).
    With a randomized design the lowest-ranked token of each partition has score 0 and is never
    sampled; give the design a ``mixture`` to keep every token possible.
    """

    name: ClassVar[str] = "lagkv"
    transform: ClassVar[str] = "within-partition rank / lag_size (in [0, 1]), 1 for sinks/tail"

    window: int = 0
    lag_size: int = 128
    cross_scoring: bool = False

    def validate(self) -> None:
        if isinstance(self.lag_size, bool) or self.lag_size < 1:
            raise ValueError(f"LagKVScore.lag_size = {self.lag_size}: expected an int >= 1")
        if not isinstance(self.cross_scoring, bool):
            raise ValueError("LagKVScore.cross_scoring must be a bool")

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        return self.lag_scores(trace, kv_head, end, self.sinks)

    def lag_scores(self, trace: LayerTrace, kv_head: int, end: int, n_sink: int) -> np.ndarray:
        """The scores with the partitions starting after ``n_sink`` positions (scored 1)."""
        lag = self.lag_size
        out = np.ones(end)
        if end < n_sink + 2 * lag:
            if end > n_sink:
                out[n_sink:] = np.arange(end - n_sink) / (end - n_sink)
            return out
        stop = n_sink + ((end - n_sink) // lag) * lag
        d = trace.keys.shape[2]
        k = trace.keys[kv_head, n_sink:stop].reshape(-1, lag, d)
        v = trace.values[kv_head, n_sink:stop].reshape(-1, lag, d)
        s = (lag_states_score(k) + lag_states_score(v)) / 2
        if not self.cross_scoring:
            s = s.argsort(axis=1, kind="stable").argsort(axis=1, kind="stable") / lag
        out[n_sink:stop - lag] = s.reshape(-1)
        return out
