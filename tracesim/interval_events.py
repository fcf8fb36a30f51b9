"""Coverage events: does an interval built from the certificate contain the true output?

Two events, pre-register which one is primary:

* per-coordinate Wald: ``|o_hat_j - o_j| <= z * sqrt(V_hat_jj)`` (z from the normal, or from
  Student's t with m-1 degrees of freedom for the small-sample variant);
* vector-level Satterthwaite: ``||o_hat - o||^2 <= a * chi2_nu(1 - alpha)`` with
  ``a = tr(V^2)/tr(V)`` and ``nu = tr(V)^2/tr(V^2)`` (a scaled chi-square matching the first two
  moments of the quadratic form).
"""

from __future__ import annotations

import numpy as np
from scipy import special

from tracesim.estimators import AttentionEstimate

__all__ = ["satterthwaite_covered", "wald_covered", "satterthwaite_quantile"]


def _small_sample_factor(result: AttentionEstimate) -> np.ndarray:
    m = np.asarray(result.tail_size, dtype=np.float64)
    with np.errstate(divide="ignore"):
        factor = np.where(m > 1, m / np.maximum(m - 1.0, 1.0), np.inf)
    return np.where(np.asarray(result.tail_population) == 0, 1.0, factor)


def wald_covered(
    result: AttentionEstimate,
    truth: np.ndarray,
    *,
    alpha: float = 0.05,
    small_sample: bool = False,
) -> np.ndarray:
    """Per-coordinate Wald coverage ``|o_hat_j - o_j| <= q * sqrt(V_jj)``.

    Parameters
    ----------
    result : AttentionEstimate
        Computed with ``variance="diag"`` or ``"full"``.
    truth : ndarray, shape like ``result.estimate``
        Full-cache output.
    alpha : float
        Two-sided level; ``q = z_{1-alpha/2}``, or ``t_{m-1, 1-alpha/2}`` with the variance
        inflated by ``m/(m-1)`` when ``small_sample`` (infinite for ``m <= 1``).

    Returns
    -------
    ndarray of bool, shape like ``result.estimate``
    """
    if result.variance_diag is None:
        raise ValueError("wald_covered needs variance_diag: use variance='diag' or 'full'")
    err = np.abs(np.asarray(result.estimate) - np.asarray(truth, dtype=np.float64))
    var = np.asarray(result.variance_diag)
    if small_sample:
        m = np.asarray(result.tail_size, dtype=np.float64)
        factor = _small_sample_factor(result)
        with np.errstate(invalid="ignore"):
            q = np.where(m > 1, special.stdtrit(np.maximum(m - 1, 1), 1 - alpha / 2), np.inf)
        q = np.where(np.asarray(result.tail_population) == 0, 0.0, q)
        with np.errstate(invalid="ignore"):
            half = np.expand_dims(q * np.sqrt(factor), -1) * np.sqrt(var)
        half = np.where(np.isnan(half), np.inf, half)
    else:
        half = special.ndtri(1 - alpha / 2) * np.sqrt(var)
    return err <= half


def satterthwaite_quantile(trace: np.ndarray, trace_sq: np.ndarray, alpha: float) -> np.ndarray:
    """``a * chi2_nu(1-alpha)`` with ``a = tr(V^2)/tr V`` and ``nu = (tr V)^2 / tr(V^2)``."""
    trace = np.asarray(trace, dtype=np.float64)
    trace_sq = np.asarray(trace_sq, dtype=np.float64)
    positive = trace > 0
    safe_t = np.where(positive, trace, 1.0)
    safe_t2 = np.where(positive, trace_sq, 1.0)
    scale = safe_t2 / safe_t
    nu = safe_t**2 / safe_t2
    return np.where(positive, scale * special.chdtri(nu, alpha), 0.0)


def satterthwaite_covered(
    result: AttentionEstimate,
    truth: np.ndarray,
    *,
    alpha: float = 0.05,
    small_sample: bool = False,
) -> np.ndarray:
    """Vector-level coverage ``||o_hat - o||^2 <= a * chi2_nu(1 - alpha)``.

    Needs ``result`` computed with ``variance="full"`` (for ``tr V^2``). With ``small_sample`` the
    variance is inflated by ``m/(m-1)`` (infinite for ``m <= 1`` with a tail population).

    Returns
    -------
    ndarray of bool, shape (n_q,) (a bool for a single query)
    """
    if result.variance_trace_sq is None:
        raise ValueError("satterthwaite_covered needs tr(V^2): use variance='full'")
    sq_err = ((np.asarray(result.estimate) - np.asarray(truth, dtype=np.float64)) ** 2).sum(-1)
    quantile = satterthwaite_quantile(result.variance_trace, result.variance_trace_sq, alpha)
    if small_sample:
        with np.errstate(invalid="ignore"):
            quantile = quantile * _small_sample_factor(result)
        quantile = np.where(np.isnan(quantile), np.inf, quantile)
    return sq_err <= quantile
