"""The Hájek attention estimator, its linearized variance, and exact attention.

For one query head and query, with logits ``s_i = scale * q . k_i`` over kept tokens ``A ∪ S``
(take-all stratum A with ``pi = 1``, sampled tail S with ``pi < 1``)::

    o_hat = sum_i exp(s_i - log pi_i) v_i / sum_i exp(s_i - log pi_i)       (Hájek)
    V_hat = sum_{i in S} (1 - pi_i) a_i^2 (v_i - o_hat)(v_i - o_hat)^T      (Poisson design)

with ``a_i`` the normalised Hájek weights. ``tr V_hat`` is the scalar certificate ``C^2``.
See ``docs/math.md`` for the derivation and the fixed-size variant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tracesim.kernels.attention import (
    NO_SINK,
    VARIANCE_FIXED,
    VARIANCE_POISSON,
    EstimateOptions,
    EstimateOutputs,
    KeptTokens,
    LogitRule,
    hajek_batch,
)

__all__ = ["AttentionEstimate", "full_attention", "hajek_attention", "logit_rule"]

_VARIANCE_LEVELS = ("trace", "diag", "full")
_DESIGN_VARIANCE = {"poisson": VARIANCE_POISSON, "fixed": VARIANCE_FIXED}


@dataclass(frozen=True)
class AttentionEstimate:
    """Result of :func:`hajek_attention`; leading axis = queries (dropped for a single 1-D query).

    Attributes
    ----------
    estimate : ndarray, shape (n_q, d_v)
        Attention output estimated from the kept tokens.
    variance_trace : ndarray, shape (n_q,)
        ``tr V_hat`` — the squared scalar certificate ``C^2`` (units: squared value units).
    variance_diag : ndarray, shape (n_q, d_v), or None
        Diagonal of ``V_hat`` (per-coordinate variances).
    variance : ndarray, shape (n_q, d_v, d_v), or None
        Full ``V_hat``.
    variance_trace_sq : ndarray, shape (n_q,), or None
        ``tr(V_hat^2)``, needed by the Satterthwaite vector-level interval.
    tail_size : ndarray of int, shape (n_q,)
        Realized number ``m`` of kept tail tokens (``pi < 1``) the query sees.
    tail_population : ndarray of int, shape (n_q,)
        Number of tail tokens (``pi < 1``, kept or not) the query would see without eviction.
    n_eff : ndarray, shape (n_q,)
        Kish effective sample size of the Hájek weights over the kept tail.
    correction : bool
        Whether the ``-log pi`` offset was applied (False: the uncorrected estimate).
    design_variance : str
        ``"poisson"`` or ``"fixed"``: which linearized variance was computed.
    """

    estimate: np.ndarray
    variance_trace: np.ndarray
    variance_diag: np.ndarray | None
    variance: np.ndarray | None
    variance_trace_sq: np.ndarray | None
    tail_size: np.ndarray
    tail_population: np.ndarray
    n_eff: np.ndarray
    correction: bool = True
    design_variance: str = "poisson"
    _batched: bool = field(default=True, repr=False)

    @property
    def certificate(self) -> np.ndarray:
        """The scalar certificate ``C = sqrt(tr V_hat)`` (value units)."""
        return np.sqrt(self.variance_trace)

    def small_sample_variance_trace(self) -> np.ndarray:
        """``m/(m-1) * tr V_hat``; +inf when ``m <= 1`` but the query has tail tokens to miss.

        With no tail population at all the estimate is exact and the variance is 0.
        """
        m = np.asarray(self.tail_size, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            inflated = np.where(m > 1, self.variance_trace * m / np.maximum(m - 1.0, 1.0), np.inf)
        return np.where(np.asarray(self.tail_population) == 0, 0.0, inflated)

    def summary(self) -> str:
        """A short human-readable description: the estimate (first query, first coordinates),
        the certificate, the tail size, Kish n_eff, and which variance was computed (the
        design's linearization, Poisson or fixed-size, and the output asked for with
        ``variance=``: trace, diagonal or full matrix)."""
        cert = np.atleast_1d(self.certificate)
        m = np.atleast_1d(self.tail_size)
        n_eff = np.atleast_1d(self.n_eff)
        est = np.atleast_2d(self.estimate)[0]
        shown = ", ".join(f"{v:.4g}" for v in est[:4]) + (", ..." if est.size > 4 else "")
        kind = "Hájek" if self.correction else "uncorrected"
        output = ("full matrix" if self.variance is not None else "diagonal"
                  if self.variance_diag is not None else "trace")
        return "\n".join([
            f"AttentionEstimate ({kind}; {self.design_variance}-design variance, {output})",
            f"  queries:          {cert.size}",
            f"  estimate:         [{shown}] (query 0, {est.size} values)",
            f"  certificate C:    median {np.median(cert):.4g}, max {np.max(cert):.4g}",
            f"  tail size m:      min {m.min()}, median {np.median(m):g}, max {m.max()}",
            f"  Kish n_eff:       min {np.min(n_eff):.4g}, median {np.median(n_eff):.4g}",
        ])


def _as_float64_2d(name: str, array: np.ndarray, columns: int | None = None) -> np.ndarray:
    a = np.ascontiguousarray(array, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"{name} must be two-dimensional, got shape {a.shape}")
    if columns is not None and a.shape[1] != columns:
        raise ValueError(f"{name} has {a.shape[1]} columns, expected {columns}")
    if not np.isfinite(a).all():
        raise ValueError(f"{name} contains NaN or Inf")
    return a


def hajek_attention(
    query: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    inclusion_probabilities: np.ndarray,
    kept: np.ndarray | None = None,
    *,
    scale: float | None = None,
    correction: bool = True,
    variance: str = "diag",
    design_variance: str = "poisson",
    query_positions: np.ndarray | None = None,
    key_positions: np.ndarray | None = None,
    logit_offset: np.ndarray | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sink: float | None = None,
) -> AttentionEstimate:
    """Estimate attention from a kept subset of the cache, with its error certificate.

    Parameters
    ----------
    query : ndarray, shape (d,) or (n_q, d)
        Post-RoPE query vector(s) of one head.
    keys : ndarray, shape (N, d)
        Post-RoPE keys of every token of the population (kept or not).
    values : ndarray, shape (N, d_v)
    inclusion_probabilities : ndarray, shape (N,)
        ``pi_i`` in [0, 1]; 1 marks the take-all stratum. Kept tokens need ``pi_i > 0``.
    kept : ndarray of bool, shape (N,), optional
        Which tokens the cache retains; default: every token with ``pi_i > 0``.
    scale : float, optional
        Softmax scale; default ``d ** -0.5``.
    correction : bool, default True
        Apply the ``-log pi`` logit offset (Hájek). False gives the uncorrected estimate that
        deterministic and naive random eviction use (its variance is reported but not meaningful).
    variance : {"trace", "diag", "full"}, default "diag"
        How much of ``V_hat`` to compute; "full" also gives ``tr(V_hat^2)``.
    design_variance : {"poisson", "fixed"}, default "poisson"
        Poisson sampling variance, or Rosén's fixed-size (order sampling) approximation.
    query_positions : ndarray of int, shape (n_q,), optional
        Positions of the queries: a query sees only keys at positions ``<=`` its own (causal).
        Default: every query sees every token.
    key_positions : ndarray of int, shape (N,), optional
        Positions of the tokens (strictly increasing); default ``arange(N)``.
    logit_offset : ndarray, shape (N,), optional
        Extra additive logit offset per token (e.g. log bootstrap weights).
    window : int, optional
        Sliding-window layer: a query at position ``t`` attends ``(t - window, t]`` only (needs
        ``query_positions``). Default: full attention.
    softcap : float, optional
        Attention-logit soft-cap ``c``: logits ``c * tanh(scale * q.k / c)`` (Gemma 2).
    sink : float, optional
        The head's learned sink logit (gpt-oss): ``exp(sink)`` enters the denominator with
        value zero, a take-all term that adds no variance (see ``docs/math.md`` section 4b).

    Returns
    -------
    AttentionEstimate

    Raises
    ------
    ValueError
        On inconsistent shapes, non-finite inputs, probabilities outside [0, 1], a kept token with
        ``pi = 0``, or a query that sees no kept token.
    """
    q = np.asarray(query, dtype=np.float64)
    single = q.ndim == 1
    q = _as_float64_2d("query", q[None, :] if single else q)
    d = q.shape[1]
    if d < 1:
        raise ValueError(f"query has dimension d = {d}, expected d >= 1")
    k = _as_float64_2d("keys", keys, d)
    N = k.shape[0]
    v = _as_float64_2d("values", values)
    if v.shape[0] != N:
        raise ValueError(f"values has {v.shape[0]} rows but keys has {N}")
    pi = np.ascontiguousarray(inclusion_probabilities, dtype=np.float64)
    if pi.shape != (N,):
        raise ValueError(f"inclusion_probabilities has shape {pi.shape}, expected ({N},)")
    if not np.isfinite(pi).all() or (pi < 0).any() or (pi > 1).any():
        raise ValueError("inclusion_probabilities must lie in [0, 1]")
    keep = pi > 0 if kept is None else np.asarray(kept, dtype=bool)
    if keep.shape != (N,):
        raise ValueError(f"kept has shape {keep.shape}, expected ({N},)")
    if (keep & (pi <= 0)).any():
        i = int(np.flatnonzero(keep & (pi <= 0))[0])
        raise ValueError(f"token {i} is kept but has inclusion probability 0")
    if variance not in _VARIANCE_LEVELS:
        raise ValueError(f"variance = {variance!r}: expected one of {_VARIANCE_LEVELS}")
    if design_variance not in _DESIGN_VARIANCE:
        raise ValueError(f"design_variance = {design_variance!r}: expected 'poisson' or 'fixed'")
    positions = np.arange(N, dtype=np.int64) if key_positions is None else np.asarray(
        key_positions, dtype=np.int64)
    if positions.shape != (N,) or (N > 1 and (np.diff(positions) <= 0).any()):
        raise ValueError(f"key_positions must be strictly increasing with shape ({N},)")
    n_q = q.shape[0]
    if query_positions is None:
        qpos = np.full(n_q, -1, dtype=np.int64)
    else:
        qpos = np.asarray(query_positions, dtype=np.int64).reshape(-1)
        if qpos.shape != (n_q,):
            raise ValueError(f"query_positions has shape {qpos.shape}, expected ({n_q},)")
        if (qpos < 0).any():
            raise ValueError(f"query_positions holds {int(qpos.min())}, expected positions "
                             ">= 0 (omit query_positions for non-causal attention)")
    offset = np.zeros(N) if logit_offset is None else np.asarray(logit_offset, dtype=np.float64)
    if offset.shape != (N,) or not np.isfinite(offset).all():
        raise ValueError(f"logit_offset must be finite with shape ({N},)")
    scale = d**-0.5 if scale is None else float(scale)
    if not (np.isfinite(scale) and scale > 0):
        raise ValueError(f"scale = {scale}: expected a finite float > 0")
    rule, sink_logit = logit_rule(scale, window, softcap, sink)
    if rule.window and query_positions is None:
        raise ValueError("window needs query_positions (a sliding window is relative to them)")

    idx = np.flatnonzero(keep)
    kk, vk = np.ascontiguousarray(k[idx]), np.ascontiguousarray(v[idx])
    pk, ok, posk = pi[idx], np.ascontiguousarray(offset[idx]), positions[idx]
    dv = v.shape[1]
    want_diag = variance in ("diag", "full")
    want_full = variance == "full"
    out = EstimateOutputs(
        est=np.empty((n_q, dv)), diag=np.empty((n_q, dv if want_diag else 1)),
        full=np.empty((n_q, dv, dv) if want_full else (n_q, 1, 1)), trace=np.empty(n_q),
        trace_sq=np.full(n_q, np.nan), tail_size=np.zeros(n_q, dtype=np.int64),
        n_eff=np.empty(n_q), visible=np.empty(n_q, dtype=np.int64))
    opts = EstimateOptions(bool(correction), _DESIGN_VARIANCE[design_variance], want_diag,
                           want_full)
    hajek_batch(q, qpos, KeptTokens(kk, vk, pk, ok, posk), rule, sink_logit, opts, out)
    est, diag, full, trace, trace_sq = out.est, out.diag, out.full, out.trace, out.trace_sq
    tail_size, n_eff, visible = out.tail_size, out.n_eff, out.visible
    if (visible == 0).any():
        r = int(np.flatnonzero(visible == 0)[0])
        raise ValueError(f"query {r} (position {qpos[r]}) sees no kept token")
    tail_positions = positions[pi < 1]
    tail_population = np.where(qpos < 0, tail_positions.size,
                               np.searchsorted(tail_positions, qpos, side="right"))
    if rule.window:
        tail_population = tail_population - np.searchsorted(tail_positions, qpos - rule.window,
                                                            side="right")

    def pick(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else (a[0] if single else a)

    return AttentionEstimate(
        estimate=pick(est), variance_trace=pick(trace),
        variance_diag=pick(diag) if want_diag else None,
        variance=pick(full) if want_full else None,
        variance_trace_sq=pick(trace_sq) if want_full else None,
        tail_size=pick(tail_size), tail_population=pick(tail_population), n_eff=pick(n_eff),
        correction=bool(correction), design_variance=design_variance, _batched=not single,
    )


def full_attention(
    query: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    *,
    scale: float | None = None,
    query_positions: np.ndarray | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sink: float | None = None,
) -> np.ndarray:
    """Exact softmax attention over every token (the full-cache reference), float64.

    Parameters
    ----------
    query : ndarray, shape (d,) or (n_q, d)
    keys : ndarray, shape (N, d)
    values : ndarray, shape (N, d_v)
    scale : float, optional
        Default ``d ** -0.5``.
    query_positions : ndarray of int, shape (n_q,), optional
        Causal positions (a query sees tokens ``0..position``).
    window, softcap, sink : optional
        As for :func:`hajek_attention`: the truth of a sliding, soft-capped or sink layer.

    Returns
    -------
    ndarray, shape (d_v,) or (n_q, d_v)
    """
    N = np.shape(keys)[0]
    return hajek_attention(query, keys, values, np.ones(N), scale=scale, variance="trace",
                           query_positions=query_positions, window=window, softcap=softcap,
                           sink=sink).estimate


def logit_rule(scale: float, window: int | None = None, softcap: float | None = None,
               sink: float | None = None) -> tuple[LogitRule, float]:
    """The kernels' :class:`~tracesim.kernels.attention.LogitRule` and sink logit, checked.

    Raises
    ------
    ValueError
        On a window that is not a positive int, a soft-cap that is not a finite float > 0, or a
        sink logit that is not finite.
    """
    if window is not None and (isinstance(window, bool) or int(window) != window
                               or int(window) < 1):
        raise ValueError(f"window = {window!r}: expected None or an int >= 1")
    if softcap is not None and not (np.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap = {softcap!r}: expected None or a finite float > 0")
    if sink is not None and not np.isfinite(sink):
        raise ValueError(f"sink = {sink!r}: expected None or a finite float")
    rule = LogitRule(float(scale), 0.0 if softcap is None else float(softcap),
                     0 if window is None else int(window))
    return rule, NO_SINK if sink is None else float(sink)
