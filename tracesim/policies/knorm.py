"""Key-norm score: small ‖k‖ means important (observed on Llama-family models)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.policies.base import Score
from tracesim.policies.context import LayerTrace

__all__ = ["KNormScore"]


@dataclass(frozen=True)
class KNormScore(Score):
    """``x_i = exp(-(‖k_i‖ - min_j ‖k_j‖) / tau)`` — a monotone transform of ``-‖k_i‖``.

    Parameters
    ----------
    temperature : float, default 0
        ``tau``; 0 means the standard deviation of the key norms over ``[0, end)`` (1 if they
        are all equal). Top-k only sees the order; PPS sees the contrast set by ``tau``.
    """

    name: ClassVar[str] = "knorm"
    transform: ClassVar[str] = "exp(-(|k| - min|k|) / tau), tau = std(|k|) by default"

    window: int = 32
    temperature: float = 0.0

    def validate(self) -> None:
        if not float(self.temperature) >= 0.0:
            raise ValueError(f"KNormScore.temperature = {self.temperature}: expected >= 0")

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        norms = np.linalg.norm(trace.keys[kv_head, :end], axis=1)
        tau = float(self.temperature) or float(norms.std()) or 1.0
        return np.exp(-(norms - norms.min()) / tau)
