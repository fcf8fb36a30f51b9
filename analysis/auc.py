"""ROC AUC with DeLong's variance, and the paired DeLong test between two signals (C4, C6).

For positives ``X_1..X_m`` and negatives ``Y_1..Y_n`` of one signal, the AUC is the
Mann–Whitney statistic ``mean_ij psi(X_i, Y_j)`` with ``psi = 1{X > Y} + 1/2 1{X = Y}``. DeLong,
DeLong & Clarke-Pearson (1988) estimate its variance from the structural components
``V10_i = mean_j psi(X_i, Y_j)`` and ``V01_j = mean_i psi(X_i, Y_j)``:
``Var = S10/m + S01/n`` with ``S`` the sample (co)variances (denominator m-1, n-1). For two
signals on the same cases the components give the covariance, hence a z-test of the difference.
Components are computed from mid-ranks in O((m+n) log(m+n)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

__all__ = ["AUCResult", "ClusterBootstrapResult", "PairedAUCResult", "cluster_bootstrap_auc",
           "delong_auc", "delong_paired_test"]


@dataclass(frozen=True)
class AUCResult:
    """ROC AUC of one signal with its DeLong standard error and a Wald interval."""

    auc: float
    variance: float
    ci_low: float
    ci_high: float
    n_positive: int
    n_negative: int
    alpha: float

    @property
    def se(self) -> float:
        return float(np.sqrt(self.variance))

    def summary(self) -> str:
        return (f"AUC {self.auc:.3f} (SE {self.se:.3f}; {100 * (1 - self.alpha):.0f}% CI "
                f"{self.ci_low:.3f}-{self.ci_high:.3f}; {self.n_positive} positive, "
                f"{self.n_negative} negative)")


@dataclass(frozen=True)
class PairedAUCResult:
    """Paired DeLong comparison of two signals scored on the same cases."""

    auc_a: float
    auc_b: float
    difference: float
    se: float
    z: float
    pvalue: float
    ci_low: float
    ci_high: float
    alpha: float

    def summary(self) -> str:
        return (f"AUC A {self.auc_a:.3f} vs B {self.auc_b:.3f}: difference {self.difference:+.3f} "
                f"({100 * (1 - self.alpha):.0f}% CI {self.ci_low:+.3f} to {self.ci_high:+.3f}), "
                f"z = {self.z:.2f}, p = {self.pvalue:.3g}")


def _split(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels)
    if s.ndim != 1 or y.shape != s.shape:
        raise ValueError(f"scores and labels must be 1-D of equal length, got {s.shape}, {y.shape}")
    if not np.isfinite(s).all():
        raise ValueError("scores contain NaN or Inf")
    values = set(np.unique(y).tolist())
    if not values <= {0, 1}:  # True == 1 and False == 0
        raise ValueError(f"labels must be 0/1 or boolean, got values {sorted(values)}")
    y = y.astype(bool)
    if y.all() or not y.any():
        raise ValueError("AUC needs at least one positive and one negative case")
    return s[y], s[~y]


def _components(pos: np.ndarray, neg: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """AUC and DeLong structural components V10 (per positive) and V01 (per negative)."""
    m, n = pos.size, neg.size
    all_ranks = stats.rankdata(np.concatenate([pos, neg]))  # mid-ranks handle ties as 1/2
    pos_ranks = stats.rankdata(pos)
    neg_ranks = stats.rankdata(neg)
    v10 = (all_ranks[:m] - pos_ranks) / n  # negatives below each positive (+1/2 per tie)
    v01 = 1.0 - (all_ranks[m:] - neg_ranks) / m
    return float(v10.mean()), v10, v01


def delong_auc(scores: np.ndarray, labels: np.ndarray, *, alpha: float = 0.05) -> AUCResult:
    """ROC AUC of ``scores`` for ``labels`` (1 = positive), with DeLong's variance.

    Parameters
    ----------
    scores : array_like, shape (n,)
        Higher means "more likely positive".
    labels : array_like of bool or 0/1, shape (n,)
    alpha : float
        For the two-sided Wald interval (clipped to [0, 1]).
    """
    pos, neg = _split(scores, labels)
    auc, v10, v01 = _components(pos, neg)
    var = (v10.var(ddof=1) if pos.size > 1 else 0.0) / pos.size + (
        v01.var(ddof=1) if neg.size > 1 else 0.0) / neg.size
    half = stats.norm.ppf(1 - alpha / 2) * np.sqrt(var)
    return AUCResult(auc=auc, variance=float(var), ci_low=max(0.0, auc - half),
                     ci_high=min(1.0, auc + half), n_positive=pos.size, n_negative=neg.size,
                     alpha=alpha)


def delong_paired_test(
    scores_a: np.ndarray, scores_b: np.ndarray, labels: np.ndarray, *, alpha: float = 0.05
) -> PairedAUCResult:
    """Paired DeLong test of ``AUC(a) = AUC(b)`` for two signals on the same cases."""
    pos_a, neg_a = _split(scores_a, labels)
    pos_b, neg_b = _split(scores_b, labels)
    auc_a, v10a, v01a = _components(pos_a, neg_a)
    auc_b, v10b, v01b = _components(pos_b, neg_b)
    m, n = pos_a.size, neg_a.size
    s10 = np.cov(np.vstack([v10a, v10b]), ddof=1) if m > 1 else np.zeros((2, 2))
    s01 = np.cov(np.vstack([v01a, v01b]), ddof=1) if n > 1 else np.zeros((2, 2))
    cov = s10 / m + s01 / n
    var_diff = cov[0, 0] + cov[1, 1] - 2 * cov[0, 1]
    diff = auc_a - auc_b
    se = float(np.sqrt(max(var_diff, 0.0)))
    if se > 0:
        z = diff / se
        p = 2 * stats.norm.sf(abs(z))
    else:  # identical rankings: no evidence of a difference
        z, p = 0.0, 1.0
    half = stats.norm.ppf(1 - alpha / 2) * se
    return PairedAUCResult(auc_a=auc_a, auc_b=auc_b, difference=diff, se=se, z=float(z),
                           pvalue=float(p), ci_low=diff - half, ci_high=diff + half, alpha=alpha)


@dataclass(frozen=True)
class ClusterBootstrapResult:
    """AUC (or paired AUC difference) with a cluster bootstrap standard error and interval."""

    estimate: float
    se: float
    ci_low: float
    ci_high: float
    pvalue: float
    n_clusters: int
    n_boot: int

    def summary(self) -> str:
        return (f"estimate {self.estimate:.3f} (cluster-bootstrap SE {self.se:.3f}, CI "
                f"{self.ci_low:.3f} to {self.ci_high:.3f}, p = {self.pvalue:.3g}; "
                f"{self.n_clusters} clusters, {self.n_boot} resamples)")


def cluster_bootstrap_auc(
    scores: np.ndarray,
    labels: np.ndarray,
    clusters: np.ndarray,
    *,
    scores_b: np.ndarray | None = None,
    null: float = 0.5,
    n_boot: int = 1000,
    seed: int = 0,
    alpha: float = 0.05,
) -> ClusterBootstrapResult:
    """AUC, or the paired difference AUC(a) - AUC(b), resampling whole clusters.

    Runs of one sequence (several configurations and seeds) are not independent, which DeLong's
    variance assumes; resampling sequences with replacement keeps their dependence. The
    interval is the percentile interval; the p-value is two-sided from the bootstrap z-score
    ``(estimate - null) / se`` (``null`` is 0.5 for one AUC and 0 for a difference).

    Parameters
    ----------
    scores, labels, clusters : array_like, shape (n,)
    scores_b : array_like, shape (n,), optional
        Second signal on the same cases: the result is the paired AUC difference.
    """
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels).astype(bool)
    g = np.asarray(clusters)
    if not (s.shape == y.shape == g.shape) or s.ndim != 1:
        raise ValueError("scores, labels and clusters must be 1-D of equal length")
    sb = None if scores_b is None else np.asarray(scores_b, dtype=np.float64)
    paired = sb is not None
    null = 0.0 if paired and null == 0.5 else null

    def stat(idx: np.ndarray) -> float:
        yy = y[idx]
        if yy.all() or not yy.any():
            return np.nan
        a = _components(s[idx][yy], s[idx][~yy])[0]
        return a - _components(sb[idx][yy], sb[idx][~yy])[0] if paired else a

    estimate = stat(np.arange(s.size))
    if np.isnan(estimate):
        raise ValueError("AUC needs at least one positive and one negative case")
    ids, inverse = np.unique(g, return_inverse=True)
    members = [np.flatnonzero(inverse == k) for k in range(ids.size)]
    rng = np.random.default_rng(seed)
    reps = []
    for _ in range(int(n_boot)):
        pick = rng.integers(0, ids.size, ids.size)
        value = stat(np.concatenate([members[k] for k in pick]))
        if not np.isnan(value):
            reps.append(value)
    reps = np.asarray(reps)
    se = float(reps.std(ddof=1)) if reps.size > 1 else np.nan
    lo, hi = (np.quantile(reps, [alpha / 2, 1 - alpha / 2]) if reps.size > 1
              else (np.nan, np.nan))
    p = float(2 * stats.norm.sf(abs(estimate - null) / se)) if se and se > 0 else np.nan
    return ClusterBootstrapResult(float(estimate), se, float(lo), float(hi), p, int(ids.size),
                                  int(reps.size))
