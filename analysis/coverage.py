"""Certificate coverage with cluster-robust confidence intervals (claim C1).

Coverage events from one sequence are correlated (same heads, same tokens, shared samples), so
the interval treats sequences as clusters: a GEE with a binomial family, logit link and
independence working correlation, whose sandwich standard errors are robust to any correlation
within a cluster. Intervals are computed on the logit scale and transformed back, so they stay
inside [0, 1]. Strata (realized tail size, Kish n_eff, oracle tail weight bins) get one
intercept each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import statsmodels.api as sm
from scipy import stats

__all__ = ["CoverageResult", "calibration_counts", "calibration_curve", "cluster_coverage"]


@dataclass(frozen=True)
class CoverageResult:
    """Empirical coverage per stratum with cluster-robust intervals.

    Attributes
    ----------
    strata : list of str
    coverage, ci_low, ci_high : ndarray, shape (n_strata,)
    n_events, n_clusters : ndarray of int, shape (n_strata,)
    nominal : float
    """

    strata: list[str]
    coverage: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    n_events: np.ndarray
    n_clusters: np.ndarray
    nominal: float
    alpha: float

    def summary(self) -> str:
        lines = [f"coverage (nominal {self.nominal:.3f}; {100 * (1 - self.alpha):.0f}% "
                 f"cluster-robust CI)"]
        for i, name in enumerate(self.strata):
            lines.append(f"  {name:>16}: {self.coverage[i]:.3f} [{self.ci_low[i]:.3f}, "
                         f"{self.ci_high[i]:.3f}]  events {self.n_events[i]}, clusters "
                         f"{self.n_clusters[i]}")
        return "\n".join(lines)


def cluster_coverage(
    covered: np.ndarray,
    clusters: np.ndarray,
    strata: np.ndarray | None = None,
    *,
    nominal: float = 0.95,
    alpha: float = 0.05,
    order: list[str] | None = None,
) -> CoverageResult:
    """Coverage per stratum with a GEE (binomial, logit, independence) sandwich interval.

    Parameters
    ----------
    covered : array_like of bool, shape (n,)
        One coverage event each.
    clusters : array_like, shape (n,)
        Cluster label of each event (e.g. sequence id).
    strata : array_like, shape (n,), optional
        Stratum label of each event; default one stratum "all".
    nominal, alpha : float
        Nominal coverage (reported) and the interval's level.
    order : list of str, optional
        Order of the strata in the result (default: sorted); absent strata are skipped.
    """
    y = np.asarray(covered, dtype=np.float64)
    groups = np.asarray(clusters)
    if y.ndim != 1 or groups.shape != y.shape:
        raise ValueError("covered and clusters must be 1-D of equal length")
    labels = np.full(y.size, "all", dtype=object) if strata is None else np.asarray(
        strata).astype(str).astype(object)
    if labels.shape != y.shape:
        raise ValueError("strata must have the same length as covered")
    present = set(labels.tolist())
    names = [s for s in order if s in present] if order is not None else sorted(present)
    z = stats.norm.ppf(1 - alpha / 2)
    out = {k: [] for k in ("cov", "lo", "hi", "n", "g")}
    _, group_codes = np.unique(groups, return_inverse=True)
    for name in names:
        sel = labels == name
        ys, gs = y[sel], group_codes[sel]
        p = ys.mean()
        n_groups = np.unique(gs).size
        if 0.0 < p < 1.0 and n_groups > 1:
            model = sm.GEE(ys, np.ones((ys.size, 1)), groups=gs, family=sm.families.Binomial(),
                           cov_struct=sm.cov_struct.Independence())
            fit = model.fit()
            b, se = float(fit.params[0]), float(fit.bse[0])
            lo, hi = 1 / (1 + np.exp(-(b - z * se))), 1 / (1 + np.exp(-(b + z * se)))
        else:
            # All covered / none covered (or one cluster): Wilson-free, exact Clopper-Pearson bound.
            k, n = int(ys.sum()), ys.size
            lo = stats.beta.ppf(alpha / 2, k, n - k + 1) if k > 0 else 0.0
            hi = stats.beta.ppf(1 - alpha / 2, k + 1, n - k) if k < n else 1.0
        out["cov"].append(p)
        out["lo"].append(lo)
        out["hi"].append(hi)
        out["n"].append(ys.size)
        out["g"].append(n_groups)
    return CoverageResult(strata=[str(s) for s in names], coverage=np.array(out["cov"]),
                          ci_low=np.array(out["lo"]), ci_high=np.array(out["hi"]),
                          n_events=np.array(out["n"]), n_clusters=np.array(out["g"]),
                          nominal=nominal, alpha=alpha)


def calibration_curve(
    standardized_error: np.ndarray, levels: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Nominal vs empirical coverage of ``|error| / sqrt(variance)`` across nominal levels.

    For a calibrated certificate, ``|e|/sd`` is ``|N(0,1)|`` and the empirical coverage of the
    interval ``z_{(1+level)/2}`` equals ``level`` for every level.

    Returns
    -------
    (levels, empirical) : ndarrays of the same shape
    """
    lv = np.linspace(0.5, 0.99, 50) if levels is None else np.asarray(levels, dtype=np.float64)
    counts, defined = calibration_counts(standardized_error, lv)
    if defined == 0:
        raise ValueError("standardized_error has no finite value")
    return lv, counts / defined


def calibration_counts(standardized_error: np.ndarray, levels: np.ndarray
                       ) -> tuple[np.ndarray, int]:
    """:func:`calibration_curve`'s counts: per level, how many ``|error| / sqrt(variance)``
    lie within ``z_{(1+level)/2}``, and how many are not NaN. Counts of batches of rows add up
    to the counts of their union."""
    t = np.abs(np.asarray(standardized_error, dtype=np.float64))
    t = t[~np.isnan(t)]
    q = stats.norm.ppf((1 + np.asarray(levels, dtype=np.float64)) / 2)
    # counts of t <= q from one sort, not a (levels x rows) matrix of comparisons
    return np.searchsorted(np.sort(t), q, side="right"), int(t.size)
