"""Deterministic top-k: the degenerate design with pi in {0, 1} and nothing random."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.designs.base import Design, validate_budget, validate_scores

__all__ = ["TopK"]


@dataclass(frozen=True)
class TopK(Design):
    """Keep the ``round(n)`` highest-scoring tail tokens.

    Ties are broken in favour of the later position (the more recent token), which is what
    recency-aware serving systems do. ``select`` ignores the uniforms.
    """

    name: ClassVar[str] = "topk"
    randomized: ClassVar[bool] = False
    variance: ClassVar[str | None] = None

    def inclusion_probabilities(self, scores: np.ndarray, n: float) -> np.ndarray:
        x = validate_scores(scores)
        N = x.size
        k = int(round(validate_budget(n, N)))
        # Reverse so the stable sort prefers the later position among equal scores.
        order = np.argsort(-x[::-1], kind="stable")[:k]
        pi = np.zeros(N)
        pi[N - 1 - order] = 1.0
        return pi

    def select(self, pi: np.ndarray, u: np.ndarray) -> np.ndarray:
        pi = np.asarray(pi, dtype=np.float64)
        if np.shape(u) != pi.shape:
            raise ValueError(f"pi has shape {pi.shape} but u has shape {np.shape(u)}")
        return pi >= 1.0
