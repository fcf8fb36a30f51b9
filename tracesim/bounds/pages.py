"""Page summaries of the tokens a policy does not keep, and the logit bounds they give.

For one KV head, the *missing* tokens (evicted by top-k, or not sampled by a Poisson design) are
grouped into pages of ``page`` consecutive positions: page ``b`` holds the missing positions in
``[b * page, (b + 1) * page)``. Each non-empty page keeps

* ``kmin``, ``kmax``: the elementwise minimum and maximum of its keys, in an orthonormal
  basis ``B`` (d x r; the identity by default) — ``kmin_j <= (B^T k_i)_j <= kmax_j``;
* ``kperp``: the largest norm of a key's part outside the basis, ``max |k_i - B B^T k_i|``
  (0 when ``r = d``);
* ``vcen``, ``vrad``: the centroid of its values and the largest distance of a value from it;
* ``count``: its number of missing tokens, and ``first``, ``last``: its first and last missing
  position (the page index; ``last`` only matters offline, see :func:`logit_lower_bounds`).

For any query ``q`` with ``q_B = B^T q`` and ``q_perp = q - B q_B``, every missing key ``k`` of
page ``b`` satisfies ``q.k = q_B.(B^T k) + q_perp.k_perp``, hence

    l_b <= scale * q.k <= u_b,
    u_b = scale * (sum_j max(q_Bj kmin_j, q_Bj kmax_j) + |q_perp| kperp_b),
    l_b = scale * (sum_j min(q_Bj kmin_j, q_Bj kmax_j) - |q_perp| kperp_b)

(``scale > 0``). These are the Quest-style page bounds; ``docs/math.md`` (section 9) turns them
into a deterministic bound on the attention error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PageSummaries", "build_page_summaries", "logit_lower_bounds", "logit_upper_bounds",
           "page_numbers", "summary_tokens"]


@dataclass(frozen=True)
class PageSummaries:
    """Summaries of the missing tokens of one KV head (non-empty pages only).

    Attributes
    ----------
    page : int
        Page size P, in positions.
    first, last : ndarray of int64, shape (n_pages,)
        First and last missing position of each page (ascending pages).
    count : ndarray of int64, shape (n_pages,)
        Missing tokens per page (>= 1).
    kmin, kmax : ndarray of float64, shape (n_pages, r)
        Elementwise key minimum / maximum in the basis coordinates ``B^T k``.
    kperp : ndarray of float64, shape (n_pages,)
        Largest norm of a key's residual ``k - B B^T k`` (zeros for a full basis).
    vcen : ndarray of float64, shape (n_pages, d)
        Value centroid (mean of the page's missing values).
    vrad : ndarray of float64, shape (n_pages,)
        Largest ``|v_i - vcen|`` over the page.
    basis : ndarray of float64, shape (d, r), or None
        Orthonormal key basis (``None``: the identity, ``r = d``).
    """

    page: int
    first: np.ndarray
    last: np.ndarray
    count: np.ndarray
    kmin: np.ndarray
    kmax: np.ndarray
    kperp: np.ndarray
    vcen: np.ndarray
    vrad: np.ndarray
    basis: np.ndarray | None = None

    @property
    def n_pages(self) -> int:
        """Number of non-empty pages."""
        return int(self.count.size)

    @property
    def head_dim(self) -> int:
        """Head dimension d."""
        return int(self.vcen.shape[1])


def _check_page(page: int) -> int:
    if isinstance(page, bool) or not isinstance(page, (int, np.integer)) or page <= 0:
        raise ValueError(f"summary_page = {page!r}: expected an integer page size >= 1 "
                         f"(positions per page)")
    return int(page)


def build_page_summaries(keys: np.ndarray, values: np.ndarray, missing: np.ndarray,
                         page: int, basis: np.ndarray | None = None) -> PageSummaries:
    """Summarise the missing tokens of one KV head in pages of ``page`` positions.

    Parameters
    ----------
    keys, values : ndarray, shape (N, d)
        Post-RoPE keys and values of positions ``0..N-1``.
    missing : ndarray of bool, shape (N,)
        Tokens the policy does not keep.
    page : int
        Positions per page (>= 1).
    basis : ndarray, shape (d, r), optional
        Orthonormal columns; key bounds are kept in ``B^T k`` plus a residual norm. Default:
        the identity (plain elementwise min/max).

    Returns
    -------
    PageSummaries
    """
    page = _check_page(page)
    keys = np.asarray(keys, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    missing = np.asarray(missing, dtype=bool)
    N, d = keys.shape
    if values.shape != (N, d) or missing.shape != (N,):
        raise ValueError(f"keys {keys.shape}, values {values.shape} and missing "
                         f"{missing.shape} must be (N, d), (N, d) and (N,)")
    pos = np.flatnonzero(missing)
    if basis is not None:
        basis = np.asarray(basis, dtype=np.float64)
        if basis.ndim != 2 or basis.shape[0] != d or basis.shape[1] > d:
            raise ValueError(f"basis must be (d, r) with r <= d = {d}, got {basis.shape}")
    r = d if basis is None else basis.shape[1]
    if pos.size == 0:
        z = np.zeros(0, dtype=np.int64)
        return PageSummaries(page, z, z.copy(), z.copy(), np.zeros((0, r)), np.zeros((0, r)),
                             np.zeros(0), np.zeros((0, d)), np.zeros(0), basis)
    pid = pos // page
    starts = np.flatnonzero(np.r_[True, pid[1:] != pid[:-1]])
    K, V = keys[pos], values[pos]
    if basis is None:
        Kb, kres = K, np.zeros(pos.size)
    else:
        Kb = K @ basis
        kres = np.linalg.norm(K - Kb @ basis.T, axis=1)
    count = np.diff(np.r_[starts, pos.size])
    vcen = np.add.reduceat(V, starts, axis=0) / count[:, None]
    vdist = np.linalg.norm(V - np.repeat(vcen, count, axis=0), axis=1)
    return PageSummaries(
        page=page, first=pos[starts].astype(np.int64),
        last=pos[np.r_[starts[1:], pos.size] - 1].astype(np.int64),
        count=count.astype(np.int64),
        kmin=np.minimum.reduceat(Kb, starts, axis=0), kmax=np.maximum.reduceat(Kb, starts, axis=0),
        kperp=np.maximum.reduceat(kres, starts), vcen=vcen,
        vrad=np.maximum.reduceat(vdist, starts), basis=basis)


def _project(query: np.ndarray, s: PageSummaries) -> tuple[np.ndarray, float]:
    q = np.asarray(query, dtype=np.float64)
    if s.basis is None:
        return q, 0.0
    qb = s.basis.T @ q
    return qb, float(np.linalg.norm(q - s.basis @ qb))


def logit_upper_bounds(query: np.ndarray, summaries: PageSummaries, scale: float) -> np.ndarray:
    """Upper bound on ``scale * q.k`` over every missing key of each page.

    Parameters
    ----------
    query : ndarray, shape (d,)
    summaries : PageSummaries
    scale : float
        Softmax scale (> 0).

    Returns
    -------
    ndarray of float64, shape (n_pages,)
        ``scale * (sum_j max(q_j kmin_j, q_j kmax_j) + |q_perp| kperp)``.
    """
    qb, qn = _project(query, summaries)
    top = np.maximum(summaries.kmin * qb, summaries.kmax * qb).sum(axis=1)
    return float(scale) * (top + qn * summaries.kperp)


def logit_lower_bounds(query: np.ndarray, summaries: PageSummaries, scale: float) -> np.ndarray:
    """Lower bound on ``scale * q.k`` over every missing key of each page (same shapes).

    Valid for the page's tokens the query can see; a bound on the page's attention mass from
    below needs the whole page visible (``last <= query position``).
    """
    qb, qn = _project(query, summaries)
    low = np.minimum(summaries.kmin * qb, summaries.kmax * qb).sum(axis=1)
    return float(scale) * (low - qn * summaries.kperp)


def page_numbers(d: int, rank: int | None = None) -> int:
    """Numbers stored per non-empty page: key min and max (``2 r``), the residual norm (if
    ``r < d``), value centroid (``d``) and radius, count and page index."""
    r = d if rank is None else int(rank)
    return 2 * r + (1 if r < d else 0) + d + 3


def summary_tokens(summaries: PageSummaries) -> float:
    """Memory of the summaries of one KV head in token-equivalents (a token is ``2 d`` numbers:
    its key and value). A basis (d x r) counts once per head."""
    d = summaries.head_dim
    r = d if summaries.basis is None else summaries.basis.shape[1]
    numbers = summaries.n_pages * page_numbers(d, r)
    if summaries.basis is not None:
        numbers += d * r
    return numbers / (2.0 * d)
