"""The shared plumbing of inclusion designs: validation and the common interface.

A design turns per-token scores of the *tail* (tokens outside the take-all stratum) and an
expected tail budget ``n`` into inclusion probabilities ``pi``, and turns ``pi`` plus permanent
uniforms ``u`` into the kept set. Scores come from policies; designs never look at positions.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import ClassVar

import numpy as np

__all__ = ["Design", "validate_scores", "validate_budget"]


def validate_scores(scores: np.ndarray, name: str = "scores") -> np.ndarray:
    """Return ``scores`` as a 1-D float64 array, or raise ``ValueError`` naming the problem."""
    x = np.asarray(scores, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {x.shape}")
    if x.size == 0:
        raise ValueError(f"{name} is empty: a design needs at least one tail token")
    bad = ~np.isfinite(x)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name}[{i}] = {x[i]}: scores must be finite")
    if (x < 0).any():
        i = int(np.flatnonzero(x < 0)[0])
        raise ValueError(f"{name}[{i}] = {x[i]}: scores must be >= 0 (shift or exponentiate them)")
    return x


def validate_budget(n: float, size: int, name: str = "n") -> float:
    """Check an expected tail budget against the number of tail tokens."""
    n = float(n)
    if not np.isfinite(n) or n <= 0:
        raise ValueError(f"{name} = {n}: the expected tail budget must be > 0")
    if n > size:
        raise ValueError(f"{name} = {n} exceeds the number of tail tokens ({size})")
    return n


@dataclass(frozen=True)
class Design:
    """Base class of inclusion designs.

    Subclasses are frozen dataclasses whose fields are the design's hyperparameters, validated in
    ``__post_init__``. Class attributes say how the design may be used:

    ``randomized``
        whether the kept set depends on the uniforms (False: nothing is random, no certificate);
    ``variance``
        which linearized variance applies: ``"poisson"`` (independent draws), ``"fixed"``
        (fixed-size order sampling, Rosén's approximation) or ``None`` (no certificate);
    ``uses_scores``
        whether the kept set depends on the scores' values (False: ``pi`` depends on the
        number of tail tokens and the budget only, as for ``bernoulli``). Configurations that
        differ only in a score such a design ignores are computed once
        (:mod:`tracesim.policies.redundancy`). A design whose answer depends on its
        hyperparameters overrides it with a property (``poisson`` with ``mixture = 1``).
        When in doubt leave it True: a wrong False merges configurations that differ.

    The dataclass fields are the design's hyperparameters: they make its label in
    ``Policy.id`` and the ``design_params`` result column (:meth:`params_json`).
    """

    name: ClassVar[str] = "design"
    randomized: ClassVar[bool] = True
    variance: ClassVar[str | None] = "poisson"
    uses_scores: ClassVar[bool] = True

    def params_json(self) -> str:
        """The hyperparameters (dataclass fields) as JSON with sorted keys; ``{}`` if none."""
        return json.dumps(asdict(self), sort_keys=True)

    def inclusion_probabilities(self, scores: np.ndarray, n: float) -> np.ndarray:
        """Inclusion probabilities of the tail tokens.

        Parameters
        ----------
        scores : array_like, shape (N,)
            Non-negative importance scores of the tail tokens.
        n : float
            Expected number of tail tokens kept, ``0 < n <= N``.

        Returns
        -------
        numpy.ndarray of float64, shape (N,)
            ``pi`` in [0, 1] with ``pi.sum() == n`` (to rounding).
        """
        raise NotImplementedError

    def select(self, pi: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Kept mask from inclusion probabilities and permanent uniforms (Poisson: ``u < pi``).

        Parameters
        ----------
        pi : numpy.ndarray, shape (N,)
        u : numpy.ndarray, shape (N,)
            Uniforms in (0, 1) from :func:`tracesim.prn.permanent_uniforms`.

        Returns
        -------
        numpy.ndarray of bool, shape (N,)
        """
        pi = np.asarray(pi, dtype=np.float64)
        u = np.asarray(u, dtype=np.float64)
        if pi.shape != u.shape:
            raise ValueError(f"pi has shape {pi.shape} but u has shape {u.shape}")
        return u < pi

    def sample(self, scores: np.ndarray, n: float, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Convenience: ``pi = inclusion_probabilities(scores, n)`` and ``kept = select(pi, u)``."""
        pi = self.inclusion_probabilities(scores, n)
        return pi, self.select(pi, u)
