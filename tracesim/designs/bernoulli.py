"""Bernoulli sampling: every tail token kept independently with the same probability."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.designs.base import Design, validate_budget, validate_scores

__all__ = ["Bernoulli"]


@dataclass(frozen=True)
class Bernoulli(Design):
    """Uniform Poisson sampling, ``pi_i = n / N`` whatever the scores (scores only fix N)."""

    name: ClassVar[str] = "bernoulli"
    randomized: ClassVar[bool] = True
    variance: ClassVar[str | None] = "poisson"
    uses_scores: ClassVar[bool] = False

    def inclusion_probabilities(self, scores: np.ndarray, n: float) -> np.ndarray:
        N = validate_scores(scores).size
        n = validate_budget(n, N)
        return np.full(N, n / N)
