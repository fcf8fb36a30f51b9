"""A deterministic bound on the attention error from the kept tokens and the page summaries.

Plain numpy, one query at a time: the reference the compiled kernel
(:mod:`tracesim.kernels.bounds`) is tested against, and the API for experiments. The derivation
is in ``docs/math.md`` (section 9); in short, with ``w_i = exp(s_i)``, kept mass ``E_R``, the
kept-only softmax average ``o_R`` and any estimate ``o_hat``,

    o - o_hat = (E_R (o_R - o_hat) + sum_{i missing} w_i (v_i - o_hat)) / (E_R + E_U),

so ``|o - o_hat| <= (E_R a + sum_b D_b W_b) / (E_R + sum_b W_b)`` with ``a = |o_R - o_hat|``,
``D_b = |vcen_b - o_hat| + vrad_b`` and the page masses ``W_b`` in ``[L_b, U_b]`` from the logit
bounds. The right side is maximised exactly over that box (:func:`ratio_box_max`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracesim.bounds.pages import PageSummaries, logit_lower_bounds, logit_upper_bounds

__all__ = ["ROUNDING", "BoundResult", "attention_error_bound", "ratio_box_max"]

#: Floating-point allowance added to every bound, relative to the largest value norm involved
#: (``max |v|`` over kept values, ``|vcen| + vrad`` over pages, ``|o_hat|``): the bound is exact
#: arithmetic, the error it is compared with is float64 arithmetic of a different summation order.
ROUNDING = 1e-10


def ratio_box_max(num0: float, den0: float, slope: np.ndarray, width: np.ndarray) -> float:
    """``max (num0 + sum_b D_b x_b) / (den0 + sum_b x_b)`` over ``0 <= x_b <= width_b``.

    A linear-fractional program over a box with a positive denominator: the optimum takes
    ``x_b = width_b`` exactly for the ``D_b`` above the optimal value, so adding pages in
    decreasing ``D`` while ``D_b`` exceeds the running ratio is exact (docs/math.md, 9.2).

    Parameters
    ----------
    num0, den0 : float
        Base numerator and denominator (``den0 >= 0``; 0 means no kept mass).
    slope, width : ndarray, shape (n,)
        ``D_b >= 0`` and ``width_b >= 0``.
    """
    order = np.argsort(-np.asarray(slope), kind="stable")
    num, den = float(num0), float(den0)
    best = num / den if den > 0 else -np.inf
    for b in order:
        if width[b] <= 0:
            continue
        if den > 0 and slope[b] <= best:
            break
        num += slope[b] * width[b]
        den += width[b]
        best = num / den
    return float(best) if np.isfinite(best) else 0.0


@dataclass(frozen=True)
class BoundResult:
    """Bound for one query.

    Attributes
    ----------
    bound : float
        Upper bound on ``|o_hat - o|`` (value units).
    mass_bound : float
        Upper bound on the missing attention mass ``E_U / (E_R + E_U)``.
    kept_average : ndarray, shape (d,)
        ``o_R``, the kept-only softmax average.
    """

    bound: float
    mass_bound: float
    kept_average: np.ndarray


def attention_error_bound(query: np.ndarray, keys: np.ndarray, values: np.ndarray,
                          kept: np.ndarray, summaries: PageSummaries, scale: float,
                          estimate: np.ndarray | None = None,
                          position: int | None = None) -> BoundResult:
    """Bound ``|o_hat - o|`` for one query from the kept tokens and the missing-page summaries.

    Parameters
    ----------
    query : ndarray, shape (d,)
    keys, values : ndarray, shape (N, d)
        Only the rows with ``kept`` are read.
    kept : ndarray of bool, shape (N,)
        Kept tokens; the summaries must cover every other visible position.
    summaries : PageSummaries
        Of the missing tokens (:func:`tracesim.bounds.build_page_summaries`).
    scale : float
        Softmax scale (> 0).
    estimate : ndarray, shape (d,), optional
        ``o_hat`` (default ``o_R``, the uncorrected kept-only average).
    position : int, optional
        Query position: tokens after it are invisible (default: all N).

    Returns
    -------
    BoundResult
    """
    N = keys.shape[0]
    t = N - 1 if position is None else int(position)
    idx = np.flatnonzero(np.asarray(kept, dtype=bool)[: t + 1])
    q = np.asarray(query, dtype=np.float64)
    s = float(scale) * (keys[idx] @ q)
    pages = summaries.first <= t
    u = logit_upper_bounds(q, summaries, scale)[pages]
    whole = summaries.last[pages] <= t
    lo = np.where(whole, logit_lower_bounds(q, summaries, scale)[pages], -np.inf)
    n = summaries.count[pages].astype(np.float64)
    top_r = s.max() if s.size else -np.inf
    shift = max(top_r, u.max() if u.size else -np.inf)
    if not np.isfinite(shift):
        shift = 0.0
    # o_R from the kept tokens' own shift (it stays exact when E_R underflows below the pages).
    w = np.exp(s - top_r) if s.size else s
    o_r = (w @ values[idx]) / w.sum() if s.size else np.zeros(keys.shape[1])
    e_r = float(w.sum() * np.exp(top_r - shift)) if s.size else 0.0
    o_hat = o_r if estimate is None else np.asarray(estimate, dtype=np.float64)
    hi = n * np.exp(u - shift)
    low = n * np.exp(lo - shift)
    dist = np.linalg.norm(summaries.vcen[pages] - o_hat, axis=1) + summaries.vrad[pages]
    a = float(np.linalg.norm(o_r - o_hat)) if s.size else 0.0
    bound = ratio_box_max(e_r * a + float(dist @ low), e_r + float(low.sum()), dist, hi - low)
    vmax = max(float(np.linalg.norm(values[idx], axis=1).max()) if idx.size else 0.0,
               float((np.linalg.norm(summaries.vcen[pages], axis=1)
                      + summaries.vrad[pages]).max()) if u.size else 0.0,
               float(np.linalg.norm(o_hat)))
    mass = float(hi.sum() / (e_r + hi.sum())) if hi.sum() > 0 else 0.0
    return BoundResult(bound=bound + ROUNDING * vmax, mass_bound=mass, kept_average=o_r)
