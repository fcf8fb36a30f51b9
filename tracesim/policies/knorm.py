"""Key-norm score: small ‖k‖ means important (observed on Llama-family models)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score

__all__ = ["KNormScore"]


@dataclass(frozen=True)
class KNormScore(Score):
    """``x_i = exp(-(‖k_i‖ - min_j ‖k_j‖) / tau)`` — a monotone transform of ``-‖k_i‖``.

    Parameters
    ----------
    temperature : float, default 0
        ``tau``; 0 means the standard deviation of the key norms over ``[0, end)`` (1 if they
        are all equal). Top-k only sees the order; PPS sees the contrast set by ``tau``.
    refresh : bool, default False
        Under ``decode:K``: at a decode-time event ``tau`` (after the one-shot compression)
        with at least one stored decode query at a position in ``[prompt_length, tau)``, the
        score becomes the full-cache attention of those decode queries (mean over them and
        over the GQA group, as SnapKV's window), i.e. the queries seen so far replace the key
        norm; before any decode query it stays the key-norm score. No effect on one-shot.
    """

    name: ClassVar[str] = "knorm"
    transform: ClassVar[str] = ("exp(-(|k| - min|k|) / tau), tau = std(|k|) by default; "
                                "refreshed: attention mass of the decode queries so far")

    window: int = 32
    temperature: float = 0.0
    refresh: bool = False

    def validate(self) -> None:
        if not float(self.temperature) >= 0.0:
            raise ValueError(f"KNormScore.temperature = {self.temperature}: expected >= 0")
        if not isinstance(self.refresh, bool):
            raise ValueError(f"KNormScore.refresh = {self.refresh!r}: expected a bool")

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        if self.refresh and end > self.compress_end(trace):
            dec = trace.role_indices("decode", before=end)
            dec = dec[trace.query_positions[dec] >= trace.prompt_length]
            if dec.size:
                return trace.group_attention(kv_head, dec)[:end]
        norms = np.linalg.norm(trace.keys[kv_head, :end], axis=1)
        tau = float(self.temperature) or float(norms.std()) or 1.0
        return np.exp(-(norms - norms.min()) / tau)
