"""Cluster-robust proportions in closed form, for many strata at once.

For an intercept-only GEE with a binomial family, logit link and independence working
correlation (what :func:`tracesim.analysis.coverage.cluster_coverage` fits with statsmodels), the
estimate and its sandwich variance have a closed form. With events ``y_i`` in [0, 1] grouped in
clusters ``c``, ``n`` events and ``p = mean(y)``:

    logit-scale estimate   b = log(p / (1 - p))
    bread                  A = n p (1 - p)
    meat                   B = sum_c (sum_{i in c} (y_i - p))^2
    robust variance        Var(b) = B / A^2

The interval ``expit(b ± z sqrt(Var b))`` is the same as statsmodels' (tested), but this runs in
one ``bincount`` pass over (stratum, cluster) pairs, so a frontier with thousands of strata costs
seconds. Degenerate strata (p in {0, 1}, or one cluster) fall back to the exact Clopper–Pearson
interval of ``round(sum y)`` successes in ``n`` events, as ``cluster_coverage`` does.

For means of any column (not only proportions), :func:`cluster_mean` gives the cluster-robust
standard error of the mean and :func:`one_sided_bounds` the Student ``t_{k-1}`` bounds the
per-step claims test with (``k`` clusters).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats

__all__ = ["cluster_mean", "cluster_proportions", "logit_se", "one_sided_bounds",
           "student_quantile"]


def cluster_proportions(y: np.ndarray, clusters: np.ndarray, strata: np.ndarray | None = None,
                        *, alpha: float = 0.05) -> pd.DataFrame:
    """Proportion, cluster-robust (1 - alpha) interval and logit standard error per stratum.

    Parameters
    ----------
    y : array_like of float, shape (n,)
        Events in [0, 1] (a coverage indicator, or a fraction of covered coordinates). NaN
        events are dropped.
    clusters : array_like, shape (n,)
        Cluster label of each event (the sequence id).
    strata : array_like, shape (n,), optional
        Stratum label of each event; default one stratum ``"all"``.
    alpha : float
        Two-sided level of the interval.

    Returns
    -------
    pandas.DataFrame
        Indexed by stratum (sorted), columns ``estimate, ci_low, ci_high, se_logit, n_events,
        n_clusters``; ``se_logit`` is NaN for degenerate strata.
    """
    y = np.asarray(y, dtype=np.float64)
    n = y.size
    groups = pd.Series(np.asarray(clusters) if not isinstance(clusters, pd.Series)
                       else clusters.to_numpy())
    labels = (pd.Series(np.zeros(n, dtype=np.int8)) if strata is None
              else pd.Series(strata.to_numpy() if isinstance(strata, pd.Series) else strata))
    if y.ndim != 1 or len(groups) != n or len(labels) != n:
        raise ValueError("y, clusters and strata must be 1-D of equal length")
    ok = ~np.isnan(y)
    y = y[ok]
    s, names = pd.factorize(labels[ok], sort=True, use_na_sentinel=False)
    names = ["all"] if strata is None else [str(x) for x in names]
    g, _ = pd.factorize(groups[ok])
    names = np.asarray(names, dtype=object)
    n_s = np.bincount(s, minlength=names.size).astype(np.float64)
    sum_s = np.bincount(s, weights=y, minlength=names.size)
    p = np.divide(sum_s, n_s, out=np.full(names.size, np.nan), where=n_s > 0)
    # Per (stratum, cluster) residual sums.
    n_g = int(g.max()) + 1 if g.size else 1
    pair = s.astype(np.int64) * n_g + g
    up, pair_idx = np.unique(pair, return_inverse=True)
    resid = np.bincount(pair_idx, weights=y - p[s], minlength=up.size)
    pair_s = up // n_g
    meat = np.bincount(pair_s, weights=resid ** 2, minlength=names.size)
    n_clusters = np.bincount(pair_s, minlength=names.size)
    bread = n_s * p * (1 - p)
    z = stats.norm.ppf(1 - alpha / 2)
    good = (p > 0) & (p < 1) & (n_clusters > 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        se = np.where(good, np.sqrt(meat) / bread, np.nan)
        b = np.log(p / (1 - p))
        lo = np.where(good, 1 / (1 + np.exp(-(b - z * se))), np.nan)
        hi = np.where(good, 1 / (1 + np.exp(-(b + z * se))), np.nan)
    for i in np.flatnonzero(~good):
        k, n = int(round(sum_s[i])), int(n_s[i])
        lo[i] = stats.beta.ppf(alpha / 2, k, n - k + 1) if k > 0 else 0.0
        hi[i] = stats.beta.ppf(1 - alpha / 2, k + 1, n - k) if k < n else 1.0
    return pd.DataFrame({"estimate": p, "ci_low": lo, "ci_high": hi, "se_logit": se,
                         "n_events": n_s.astype(np.int64), "n_clusters": n_clusters},
                        index=pd.Index(list(names), name="stratum"))


def logit_se(low: float, high: float, alpha: float) -> float:
    """Logit-scale standard error implied by a symmetric logit-scale (1 - alpha) interval."""
    if not 0 < low < high < 1:
        return float("nan")
    return float((np.log(high / (1 - high)) - np.log(low / (1 - low)))
                 / (2 * stats.norm.ppf(1 - alpha / 2)))


def cluster_mean(values: pd.Series, clusters: pd.Series) -> tuple[float, float, int]:
    """Mean of a column, its cluster-robust standard error and the number of clusters.

    Parameters
    ----------
    values : pandas.Series of float, shape (n,)
        One value per row (in the column's units); NaN rows are dropped.
    clusters : pandas.Series, shape (n,)
        Cluster label of each row (the sequence id).

    Returns
    -------
    mean, se : float
        The mean over the kept rows and ``sqrt(k / (k - 1) * sum_c r_c^2) / n`` with ``r_c`` a
        cluster's sum of residuals, in the values' units; ``se`` is NaN with fewer than 2
        clusters (one sequence says nothing about the next); both NaN without rows.
    k : int
        Number of clusters with a kept row.
    """
    ok = values.notna()
    v, c = values[ok].to_numpy(float), clusters[ok].to_numpy()
    if v.size == 0:
        return float("nan"), float("nan"), 0
    m = v.mean()
    sums = pd.Series(v - m).groupby(c).sum().to_numpy()
    k = sums.size
    if k < 2:
        return float(m), float("nan"), k
    return float(m), float(np.sqrt(k / (k - 1) * (sums**2).sum()) / v.size), k


def student_quantile(p: float, k: int) -> float:
    """The ``p`` quantile of Student's t with ``k - 1`` degrees of freedom (``k`` clusters);
    NaN below 2 clusters."""
    return float(stats.t.ppf(p, k - 1)) if k >= 2 else float("nan")


def one_sided_bounds(values: pd.Series, clusters: pd.Series,
                     p: float) -> tuple[float, float, float]:
    """Mean and its ``p`` one-sided bounds below and above (cluster-robust, ``t_{k-1}``).

    Returns ``(mean, mean - t_p se, mean + t_p se)`` in the values' units, with ``se`` and
    ``k`` from :func:`cluster_mean`; the bounds are NaN below 2 clusters, which makes every
    verdict that compares them inconclusive.
    """
    m, se, k = cluster_mean(values, clusters)
    half = student_quantile(p, k) * se
    return m, m - half, m + half
