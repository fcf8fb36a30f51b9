"""Synthetic attention populations with known ground truth: the heads of the Monte Carlo
coverage test (``tests/test_coverage_mc.py``) and of the coverage table in ``docs/math.md``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracesim.designs import inclusion_probabilities

__all__ = ["SyntheticHead", "synthetic_head"]


@dataclass(frozen=True)
class SyntheticHead:
    """One attention head's population: queries, keys, values and a take-all/tail split.

    Attributes
    ----------
    queries : ndarray, shape (n_q, d)
    keys, values : ndarray, shape (N, d)
    take_all : ndarray of bool, shape (N,)
        Sinks and the recent window (``pi = 1``).
    scale : float
        Softmax scale.
    """

    queries: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    take_all: np.ndarray
    scale: float

    def truth(self) -> np.ndarray:
        """Full-cache attention output, shape (n_q, d), float64."""
        s = self.queries @ self.keys.T * self.scale
        w = np.exp(s - s.max(axis=1, keepdims=True))
        return (w / w.sum(axis=1, keepdims=True)) @ self.values

    def inclusion(self, tail_budget: float, *, mixture: float = 0.2, query: int = 0) -> np.ndarray:
        """Capped-PPS inclusion probabilities from query ``query``'s attention; take-all = 1."""
        s = self.keys @ self.queries[query] * self.scale
        x = np.exp(s - s.max())[~self.take_all]
        pi = np.ones(self.keys.shape[0])
        pi[~self.take_all] = inclusion_probabilities(x, tail_budget, mixture=mixture)
        return pi


def synthetic_head(
    rng: np.random.Generator,
    n_tokens: int = 512,
    d: int = 16,
    *,
    n_queries: int = 1,
    logit_std: float = 1.5,
    n_sinks: int = 4,
    n_recent: int = 16,
) -> SyntheticHead:
    """Draw a head whose logits are roughly ``N(0, logit_std^2)`` and values ``N(0, I)``.

    Keys are Gaussian and the queries are scaled so that ``scale * q . k`` has standard deviation
    ``logit_std``; the first ``n_sinks`` and last ``n_recent`` tokens form the take-all stratum.
    """
    keys = rng.normal(size=(n_tokens, d))
    values = rng.normal(size=(n_tokens, d))
    q = rng.normal(size=(n_queries, d))
    q *= logit_std / np.linalg.norm(q, axis=1, keepdims=True)
    take_all = np.zeros(n_tokens, dtype=bool)
    take_all[:n_sinks] = True
    take_all[n_tokens - n_recent:] = True
    return SyntheticHead(queries=q, keys=keys, values=values, take_all=take_all, scale=1.0)
