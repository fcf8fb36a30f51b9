"""Expected attention (after kvpress ``ExpectedAttentionPress``) from stored query statistics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.policies.base import Score
from tracesim.policies.context import LayerTrace

__all__ = ["ExpectedAttentionScore", "expected_attention"]


def expected_attention(keys: np.ndarray, queries: np.ndarray, scale: float,
                       use_covariance: bool) -> np.ndarray:
    """Softmax over keys of ``scale k·mu + scale²/2 kᵀ Σ k`` for a Gaussian query model.

    Parameters
    ----------
    keys : ndarray, shape (n, d)
    queries : ndarray, shape (m, d)
        The sample whose mean ``mu`` and covariance ``Σ`` (divided by ``m``) model the queries.
    scale : float
        Softmax scale of the model (``1/sqrt(d)`` for most models).

    Returns
    -------
    ndarray, shape (n,), sums to 1.
    """
    mu = queries.mean(axis=0)
    s = scale * (keys @ mu)
    if use_covariance and queries.shape[0] > 1:
        c = queries - mu
        cov = c.T @ c / queries.shape[0]
        s = s + 0.5 * scale**2 * np.einsum("nd,de,ne->n", keys, cov, keys)
    e = np.exp(s - s.max())
    return e / e.sum()


@dataclass(frozen=True)
class ExpectedAttentionScore(Score):
    """``E[softmax(q·k)]`` under a Gaussian model of the stored queries, times ``‖v‖``.

    For each query head of the group, the mean ``mu`` and covariance ``Σ`` of the stored
    post-RoPE queries at positions in ``[sinks, end)`` (every role the store holds there: the
    context/question windows, or every prompt position for stores captured with
    ``--all-positions``) define ``s_i = scale k_i·mu + scale²/2 k_iᵀ Σ k_i`` over the keys
    ``[sinks, end)``; the softmax of ``s`` is averaged over the group and, with ``use_vnorm``,
    rescaled as ``(x_i + epsilon) ‖v_i‖``. The sinks get the largest score (and are take-all).

    Difference from kvpress: kvpress takes the statistics of the *pre-RoPE* queries of every
    prompt position after the sinks and rotates them with the RoPE matrix averaged over the next
    ``n_future_positions`` positions. A trace holds post-RoPE queries only (at the positions it
    recorded), so here the statistics are those of the recorded post-RoPE queries themselves:
    a model of the *observed* queries, not of future ones.
    """

    name: ClassVar[str] = "expected_attention"
    transform: ClassVar[str] = "expected attention mass x |v| (>= 0 as is)"

    window: int = 0
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def validate(self) -> None:
        for f in ("use_covariance", "use_vnorm"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"ExpectedAttentionScore.{f} must be a bool")
        if not float(self.epsilon) >= 0.0:
            raise ValueError(f"ExpectedAttentionScore.epsilon = {self.epsilon}: expected >= 0")

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        lo = min(self.sinks, end - 1)
        idx = np.flatnonzero((trace.query_positions >= lo) & (trace.query_positions < end))
        if idx.size == 0:
            raise ValueError(f"expected_attention: no stored query in [{lo}, {end}) in "
                             f"sequence {trace.sequence_id!r}")
        keys = trace.keys[kv_head, lo:end]
        acc = np.zeros(end - lo)
        heads = trace.group(kv_head)
        for h in heads:
            acc += expected_attention(keys, trace.queries[h, idx], trace.scale,
                                      self.use_covariance)
        x = acc / len(heads)
        if self.use_vnorm:
            x = (x + float(self.epsilon)) * np.linalg.norm(trace.values[kv_head, lo:end], axis=1)
        out = np.empty(end)
        out[lo:] = x
        out[:lo] = x.max() + 1.0 if x.size else 1.0
        return out
