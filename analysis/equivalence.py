"""Paired equivalence (TOST) and non-inferiority tests (claims C2, C3, C5).

Pairs are units measured under two conditions (e.g. the same sequence with randomized and with
deterministic eviction at equal budget). With ``d_k = a_k - b_k``, equivalence within
``(-margin, +margin)`` is shown when both one-sided t-tests reject, i.e. when the ``1 - 2 alpha``
confidence interval of the mean difference lies inside the margins; the TOST p-value is the
larger of the two one-sided p-values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

__all__ = ["EquivalenceResult", "paired_noninferiority", "paired_tost"]


@dataclass(frozen=True)
class EquivalenceResult:
    """Outcome of a paired TOST or non-inferiority test on ``mean(a - b)``."""

    test: str
    mean_difference: float
    se: float
    df: int
    ci_low: float
    ci_high: float
    pvalue: float
    lower_margin: float
    upper_margin: float
    alpha: float
    n_pairs: int

    @property
    def supported(self) -> bool:
        """Equivalence (or non-inferiority) shown at level alpha."""
        return self.pvalue < self.alpha

    def summary(self) -> str:
        verdict = "shown" if self.supported else "not shown"
        return (f"{self.test}: mean difference {self.mean_difference:+.4g} (SE {self.se:.3g}, "
                f"{100 * (1 - 2 * self.alpha):.0f}% CI {self.ci_low:+.4g} to {self.ci_high:+.4g}), "
                f"margins ({self.lower_margin:+.4g}, {self.upper_margin:+.4g}), "
                f"p = {self.pvalue:.3g}, {self.n_pairs} pairs: {verdict}")


def _differences(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"a and b must be 1-D of equal length, got {a.shape} and {b.shape}")
    if a.size < 2:
        raise ValueError("a paired test needs at least 2 pairs")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("a and b must be finite")
    return a - b


def paired_tost(
    a: np.ndarray, b: np.ndarray, margin: float | tuple[float, float], *, alpha: float = 0.05
) -> EquivalenceResult:
    """Two one-sided paired t-tests: is ``mean(a - b)`` inside ``(low, high)``?

    Parameters
    ----------
    a, b : array_like, shape (n,)
        Paired measurements.
    margin : float or (low, high)
        Symmetric margin ``m`` meaning ``(-m, m)``, or explicit bounds.
    alpha : float
        Level of each one-sided test.
    """
    low, high = (-abs(margin), abs(margin)) if np.isscalar(margin) else map(float, margin)
    if not low < high:
        raise ValueError(f"margin: lower bound {low} must be below upper bound {high}")
    d = _differences(a, b)
    n = d.size
    mean = float(d.mean())
    se = float(d.std(ddof=1) / np.sqrt(n))
    df = n - 1
    if se == 0:
        p = 0.0 if low < mean < high else 1.0
    else:
        p_low = stats.t.sf((mean - low) / se, df)
        p_high = stats.t.cdf((mean - high) / se, df)
        p = float(max(p_low, p_high))
    half = stats.t.ppf(1 - alpha, df) * se
    return EquivalenceResult("paired TOST", mean, se, df, mean - half, mean + half, p, low, high,
                             alpha, n)


def paired_noninferiority(
    a: np.ndarray, b: np.ndarray, margin: float, *, alpha: float = 0.05,
    higher_is_better: bool = True,
) -> EquivalenceResult:
    """One-sided paired t-test that ``a`` is not worse than ``b`` by more than ``margin``.

    With ``higher_is_better`` (accuracy) the null is ``mean(a - b) <= -margin``; otherwise
    (error) it is ``mean(a - b) >= margin``.
    """
    margin = abs(float(margin))
    d = _differences(a, b)
    n = d.size
    mean = float(d.mean())
    se = float(d.std(ddof=1) / np.sqrt(n))
    df = n - 1
    half = stats.t.ppf(1 - alpha, df) * se
    if higher_is_better:
        p = (0.0 if mean > -margin else 1.0) if se == 0 else float(
            stats.t.sf((mean + margin) / se, df))
        return EquivalenceResult("paired non-inferiority", mean, se, df, mean - half, np.inf, p,
                                 -margin, np.inf, alpha, n)
    p = (0.0 if mean < margin else 1.0) if se == 0 else float(stats.t.cdf((mean - margin) / se, df))
    return EquivalenceResult("paired non-inferiority", mean, se, df, -np.inf, mean + half, p,
                             -np.inf, margin, alpha, n)
