"""Poisson sampling with capped probability-proportional-to-size inclusion probabilities."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.designs.base import Design, validate_budget, validate_scores
from tracesim.kernels.inclusion import apply_capped_pps, capped_pps_scale

__all__ = ["PoissonPPS", "inclusion_probabilities"]


def inclusion_probabilities(
    scores: np.ndarray,
    n: float,
    *,
    mixture: float = 0.0,
    floor: float = 0.0,
) -> np.ndarray:
    """Exact capped PPS inclusion probabilities ``pi_i = clip(c * x_i, floor, 1)``, ``sum pi = n``.

    Parameters
    ----------
    scores : array_like, shape (N,)
        Non-negative, finite importance scores ``x_i`` of the tail tokens, not all zero.
    n : float
        Expected number of kept tail tokens, ``0 < n <= N``.
    mixture : float, default 0
        Defensive mixture weight ``lambda`` in [0, 1]:
        ``x <- (1 - lambda) x / sum(x) + lambda / N``,
        which bounds every ``pi`` below by about ``lambda * n / N``.
    floor : float, default 0
        Lower bound on every ``pi`` (``N * floor <= n`` is required).

    Returns
    -------
    numpy.ndarray of float64, shape (N,)
        Inclusion probabilities in [0, 1], monotone in the score, summing to ``n``; a token whose
        ``c * x_i`` reaches 1 gets exactly 1.0 (the take-all part of the tail).

    Notes
    -----
    ``c`` is found exactly: ``sum_i clip(c x_i, floor, 1)`` is piecewise linear in ``c``, so a
    sweep over the sorted breakpoints finds the segment holding ``n`` (O(N log N)). See
    ``docs/math.md``. Tokens with score 0 get ``pi = floor`` (never sampled when ``floor = 0``:
    the Hájek estimator then cannot see them, and neither can its certificate).

    Examples
    --------
    >>> inclusion_probabilities([4.0, 1.0, 1.0, 1.0, 1.0], 2.0)
    array([1.  , 0.25, 0.25, 0.25, 0.25])
    """
    x = validate_scores(scores)
    N = x.size
    n = validate_budget(n, N)
    mixture = float(mixture)
    floor = float(floor)
    if not 0.0 <= mixture <= 1.0:
        raise ValueError(f"mixture = {mixture}: expected a value in [0, 1]")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor = {floor}: expected a value in [0, 1]")
    if floor * N > n * (1 + 1e-12):
        raise ValueError(f"floor = {floor} is infeasible: N * floor = {floor * N} > n = {n}")
    # pi is invariant to scaling the scores; dividing by the maximum first keeps the sums
    # below (and the mixture) finite for any finite input (e.g. 512 scores of 1e306).
    top = x.max() if N else 0.0
    if top > 0.0:
        x = x / top
    total = x.sum()
    if total <= 0.0 and mixture < 1.0:
        raise ValueError("scores are all zero: capped PPS needs at least one positive score")
    if mixture > 0.0:
        x = (1.0 - mixture) * (x / total if total > 0 else 0.0 * x) + mixture / N
    positive = int(np.count_nonzero(x > 0))
    if positive + (N - positive) * floor < n * (1 - 1e-12):
        raise ValueError(
            f"n = {n} cannot be reached: only {positive} tail tokens have a positive score "
            f"(use mixture > 0 or floor > 0 to give the others a chance)"
        )
    if n >= N:
        return np.ones(N)
    c = capped_pps_scale(x, n, floor)
    if c < 0:  # pragma: no cover - excluded by the feasibility check above
        raise ValueError(f"n = {n} cannot be reached with these scores")
    pi = np.empty(N)
    apply_capped_pps(x, c, floor, pi)
    return pi


@dataclass(frozen=True)
class PoissonPPS(Design):
    """Poisson sampling, capped PPS: keep tail token i independently iff ``u_i < pi_i``.

    Parameters
    ----------
    mixture : float, default 0
        Defensive mixture weight ``lambda`` in [0, 1] (see :func:`inclusion_probabilities`).
    floor : float, default 0
        Lower bound on each inclusion probability.
    """

    name: ClassVar[str] = "poisson"
    randomized: ClassVar[bool] = True
    variance: ClassVar[str | None] = "poisson"

    mixture: float = 0.0
    floor: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.mixture <= 1.0:
            raise ValueError(f"PoissonPPS.mixture = {self.mixture}: expected a value in [0, 1]")
        if not 0.0 <= self.floor < 1.0:
            raise ValueError(f"PoissonPPS.floor = {self.floor}: expected a value in [0, 1)")

    @property
    def uses_scores(self) -> bool:  # type: ignore[override]
        """False with ``mixture = 1``: every tail token then gets the same ``pi``."""
        return self.mixture != 1.0

    def inclusion_probabilities(self, scores: np.ndarray, n: float) -> np.ndarray:
        return inclusion_probabilities(scores, n, mixture=self.mixture, floor=self.floor)
