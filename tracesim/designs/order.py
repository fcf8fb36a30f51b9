"""Fixed-size designs: Pareto and sequential Poisson order sampling (Rosén).

When memory must be exact, keep exactly ``n`` tail tokens: rank tokens by a variable built from
their permanent uniform and a target probability ``lambda_i`` (capped PPS), and keep the n
smallest. The inclusion probabilities are then approximately ``lambda_i`` (very closely for
Pareto), and the variance follows Rosén's fixed-size approximation (see ``docs/math.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.designs.base import Design
from tracesim.designs.poisson import inclusion_probabilities
from tracesim.kernels.inclusion import order_sample

__all__ = ["OrderSampling"]


@dataclass(frozen=True)
class OrderSampling(Design):
    """Fixed-size order sampling with capped-PPS target probabilities.

    Parameters
    ----------
    kind : {"pareto", "sequential"}
        Pareto ranks by ``[u/(1-u)] / [lambda/(1-lambda)]``, sequential Poisson by ``u/lambda``.
    mixture, floor : float
        As for :class:`~tracesim.designs.PoissonPPS`, applied to the target probabilities.

    Notes
    -----
    ``inclusion_probabilities`` returns the targets ``lambda`` (whose sum is the fixed size n, so n
    must be an integer); they are the approximate inclusion probabilities used by the estimator.
    """

    name: ClassVar[str] = "fixed"
    randomized: ClassVar[bool] = True
    variance: ClassVar[str | None] = "fixed"

    kind: str = "pareto"
    mixture: float = 0.0
    floor: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("pareto", "sequential"):
            raise ValueError(
                f"OrderSampling.kind = {self.kind!r}: expected 'pareto' or 'sequential'")
        if not 0.0 <= self.mixture <= 1.0:
            raise ValueError(f"OrderSampling.mixture = {self.mixture}: expected a value in [0, 1]")
        if not 0.0 <= self.floor < 1.0:
            raise ValueError(f"OrderSampling.floor = {self.floor}: expected a value in [0, 1)")

    @property
    def uses_scores(self) -> bool:  # type: ignore[override]
        """False with ``mixture = 1``: every tail token then gets the same ``pi``."""
        return self.mixture != 1.0

    def inclusion_probabilities(self, scores: np.ndarray, n: float) -> np.ndarray:
        if abs(n - round(n)) > 1e-9:
            raise ValueError(f"n = {n}: a fixed-size design needs an integer sample size")
        return inclusion_probabilities(scores, round(n), mixture=self.mixture, floor=self.floor)

    def select(self, pi: np.ndarray, u: np.ndarray) -> np.ndarray:
        pi = np.ascontiguousarray(pi, dtype=np.float64)
        u = np.ascontiguousarray(u, dtype=np.float64)
        if pi.shape != u.shape:
            raise ValueError(f"pi has shape {pi.shape} but u has shape {u.shape}")
        kept = np.empty(pi.size, dtype=np.bool_)
        order_sample(pi, u, int(round(pi.sum())), self.kind == "pareto", kept)
        return kept
