"""Expected attention (after kvpress ``ExpectedAttentionPress``) from stored query statistics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score

__all__ = ["ROPE_TYPES", "ExpectedAttentionScore", "average_rope", "expected_attention",
           "rope_inv_freq", "unrotate"]


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
        return finish_scores(self, acc / len(heads), trace, kv_head, lo, end)


# ----------------------------------------------------------------------------- RoPE (kvpress)

#: RoPE types whose frequencies depend on the model only (not on the sequence length).
ROPE_TYPES = ("default", "linear", "llama3")


def finish_scores(score, x: np.ndarray, trace: LayerTrace, kv_head: int, lo: int,
                  end: int) -> np.ndarray:
    """Scores of ``[0, end)`` from the expected attention ``x`` of ``[lo, end)``: weighted by
    ``(x + epsilon) |v|`` with ``use_vnorm``, and the protected prefix ``[0, lo)`` above every
    other score (shared by the tracesim score and the kvpress press)."""
    if score.use_vnorm:
        x = (x + float(score.epsilon)) * np.linalg.norm(trace.values[kv_head, lo:end], axis=1)
    out = np.empty(end)
    out[lo:] = x
    out[:lo] = x.max() + 1.0 if x.size else 1.0
    return out


def rope_inv_freq(head_dim: int, rope: dict) -> np.ndarray:
    """RoPE inverse frequencies, shape (head_dim // 2,), from ``{"rope_theta", "rope_scaling"}``
    (Hugging Face's ``default``, ``linear`` and ``llama3`` rules).

    Raises
    ------
    ValueError
        For another ``rope_type`` (``dynamic``, ``yarn``, ... depend on the sequence length
        or rescale attention; not supported).
    """
    theta = float(rope["rope_theta"])
    sc = dict(rope.get("rope_scaling") or {})
    kind = str(sc.get("rope_type", sc.get("type", "default")))
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "llama3":
        factor = float(sc["factor"])
        lo_f, hi_f = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * np.pi / inv
        out = np.where(wavelen > old / lo_f, inv / factor, inv)
        smooth = (old / wavelen - lo_f) / (hi_f - lo_f)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < old / hi_f) & ~(wavelen > old / lo_f)
        return np.where(medium, smoothed, out)
    raise ValueError(f"rope_scaling type {kind!r}: expected one of {list(ROPE_TYPES)} (the "
                     "others depend on the sequence length or rescale attention)")


def _cos_sin(inv_freq: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    ang = np.concatenate([ang, ang], axis=1)
    return np.cos(ang), np.sin(ang)


def _rotate_half(x: np.ndarray) -> np.ndarray:
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def unrotate(q: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Pre-RoPE queries from post-RoPE ones, ``q`` shape (n, d) at ``positions`` (n,)."""
    cos, sin = _cos_sin(inv_freq, positions)
    return q * cos - _rotate_half(q) * sin


def average_rope(inv_freq: np.ndarray, start: int, n: int) -> np.ndarray:
    """The RoPE matrix averaged over positions ``[start, start + n)``, shape (d, d): row
    vectors ``x`` rotate as ``x @ R.T``."""
    cos, sin = _cos_sin(inv_freq, np.arange(start, start + n))
    d = cos.shape[1]
    h = d // 2
    perm = np.zeros((d, d))
    perm[h:, :h] = np.eye(h)
    perm[:h, h:] = -np.eye(h)
    return cos.mean(axis=0)[None, :] * np.eye(d) + sin.mean(axis=0)[None, :] * perm
