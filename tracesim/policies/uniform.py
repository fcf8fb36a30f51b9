"""Random eviction: uniform noise as the score (the naive baseline, uncorrected by default)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score

__all__ = ["RandomScore"]


@dataclass(frozen=True)
class RandomScore(Score):
    """``x_i = u_i``: permanent uniforms of stream 1 (> 0).

    With ``topk`` this keeps a simple random sample of exactly the budget; with ``bernoulli``
    each tail token is kept with the same probability. The naive baseline applies no correction
    (``default_correction = "none"``); since its probabilities are uniform, Hájek would only
    renormalise, and a ``hajek`` correction with a randomized design does get a certificate.
    """

    name: ClassVar[str] = "random"
    seed_dependent: ClassVar[bool] = True
    default_correction: ClassVar[str] = "none"
    transform: ClassVar[str] = "uniform noise in (0, 1)"

    window: int = 0

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        return trace.perturbation_uniforms(0 if seed is None else seed, kv_head, end)
