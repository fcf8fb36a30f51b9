"""Certificates beyond the primary linearized one: Poisson bootstrap and the GQA output space.

The primary certificate ``tr V_hat`` and its small-sample variant come with
:func:`tracesim.hajek_attention` (:meth:`AttentionEstimate.small_sample_variance_trace`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracesim.estimators import _as_float64_2d, hajek_attention, logit_rule
from tracesim.kernels.attention import NO_SINK, KeptTokens, output_space_batch

__all__ = ["OutputSpaceCertificate", "bootstrap_certificate", "output_space_certificate"]


def bootstrap_certificate(
    query: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    inclusion_probabilities: np.ndarray,
    kept: np.ndarray,
    *,
    n_replicates: int = 200,
    seed: int | np.random.Generator = 0,
    scale: float | None = None,
    query_positions: np.ndarray | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sink: float | None = None,
    replicate_weights: np.ndarray | None = None,
    per_coordinate: bool = False,
) -> np.ndarray:
    """Poisson-bootstrap variance of the Hájek estimate (the trace, like ``C^2``).

    Each replicate multiplies the weight of every kept tail token by an independent
    ``Gamma(shape=1/(1-pi), scale=1-pi)`` draw (mean 1, variance ``1 - pi``, matching the Poisson
    design's ``Var(1{i in S}/pi | i in S)`` structure); take-all tokens keep weight 1. A weight
    enters attention as the extra logit offset ``log w``. The certificate is the mean over
    replicates of ``||o_hat_r - o_hat||^2``.

    Parameters
    ----------
    query, keys, values, inclusion_probabilities, kept, scale, query_positions
        As for :func:`tracesim.hajek_attention`.
    window, softcap, sink
        The layer's attention variant, as for :func:`tracesim.hajek_attention`.
    n_replicates : int, default 200
    seed : int or numpy.random.Generator
        Replicate weights come from ``numpy.random.default_rng(seed)``: derive the seed from
        (run seed, layer, head) for results that do not depend on the order of work.
        Ignored with ``replicate_weights``.
    replicate_weights : ndarray, shape (n_replicates, N), optional
        Given multipliers instead of the Gamma draws (e.g. the replay's multipliers from
        :func:`tracesim.prn.bootstrap_weights` with the tokens' ``pi``); only the kept tail
        tokens' entries are read, and ``n_replicates`` is the number of rows.
    per_coordinate : bool, default False
        Return the per-coordinate variances (shape ``(n_q, d)``) instead of their sum.

    Returns
    -------
    ndarray, shape (n_q,) (a float for a single 1-D query), or (n_q, d) with ``per_coordinate``
    """
    pi = np.asarray(inclusion_probabilities, dtype=np.float64)
    keep = np.asarray(kept, dtype=bool)
    given = None if replicate_weights is None else np.asarray(replicate_weights, np.float64)
    if given is not None:
        if given.ndim != 2 or given.shape[1] != pi.shape[-1]:
            raise ValueError(f"replicate_weights has shape {given.shape}, expected "
                             f"(n_replicates, {pi.shape[-1]})")
        n_replicates = given.shape[0]
    if int(n_replicates) < 2:
        raise ValueError(f"n_replicates = {n_replicates}: expected at least 2")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    variant = dict(window=window, softcap=softcap, sink=sink)
    base = hajek_attention(query, keys, values, pi, keep, scale=scale, variance="trace",
                           query_positions=query_positions, **variant)
    tail = keep & (pi < 1)
    shape = 1.0 / (1.0 - pi[tail])
    gamma_scale = 1.0 - pi[tail]
    acc = np.zeros(np.shape(base.estimate) if per_coordinate
                   else np.shape(base.variance_trace))
    offset = np.zeros(pi.shape)
    for r in range(int(n_replicates)):
        weights = rng.gamma(shape, gamma_scale) if given is None else given[r][tail]
        # A zero draw (possible in floating point for tiny shape, and a Poisson count of 0)
        # would mean -inf; floor it.
        offset[tail] = np.log(np.maximum(weights, 1e-300))
        rep = hajek_attention(query, keys, values, pi, keep, scale=scale, variance="trace",
                              query_positions=query_positions, logit_offset=offset,
                              **variant)
        dev2 = (rep.estimate - base.estimate) ** 2
        acc += dev2 if per_coordinate else dev2.sum(axis=-1)
    return acc / int(n_replicates)


@dataclass(frozen=True)
class OutputSpaceCertificate:
    """Per-layer certificate in the residual stream (after ``o_proj``), composing GQA groups.

    Attributes
    ----------
    head_estimates : ndarray, shape (n_heads, n_q, head_dim)
        Hájek estimates of every query head.
    group_variance : ndarray, shape (n_kv_heads, n_q)
        ``sum_{i in S_g} (1-pi_i) || sum_{h in g} a_{h,i} W_O,h (v_i - o_hat_h) ||^2``.
    variance_trace : ndarray, shape (n_q,)
        Sum over groups (independent samples): the squared layer certificate.
    output_estimate : ndarray, shape (n_q, hidden)
        ``sum_h W_O,h o_hat_h``: the estimated attention contribution to the residual stream.
    """

    head_estimates: np.ndarray
    group_variance: np.ndarray
    variance_trace: np.ndarray
    output_estimate: np.ndarray

    @property
    def certificate(self) -> np.ndarray:
        """``sqrt(variance_trace)`` in residual-stream units."""
        return np.sqrt(self.variance_trace)

    def summary(self) -> str:
        """A short human-readable description."""
        c = self.certificate
        return (f"OutputSpaceCertificate: {self.group_variance.shape[0]} groups, {c.size} queries, "
                f"certificate median {np.median(c):.4g}, max {np.max(c):.4g}")


def output_space_certificate(
    queries: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    inclusion_probabilities: np.ndarray,
    kept: np.ndarray,
    o_proj: np.ndarray,
    *,
    scale: float | None = None,
    query_positions: np.ndarray | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
) -> OutputSpaceCertificate:
    """Linearized variance of a layer's attention output after ``o_proj``, under GQA.

    Query heads of one group share one KV head and hence one sample; groups are independent.

    Parameters
    ----------
    queries : ndarray, shape (n_heads, n_q, d)
    keys, values : ndarray, shape (n_kv_heads, N, d)
    inclusion_probabilities : ndarray, shape (n_kv_heads, N)
        Per KV head (heads may have different budgets).
    kept : ndarray of bool, shape (n_kv_heads, N)
    o_proj : ndarray, shape (hidden, n_heads * d)
        The layer's output projection (``o_proj.weight``); columns ``h*d:(h+1)*d`` are ``W_O,h``.
    scale, query_positions, window, softcap
        As for :func:`tracesim.hajek_attention`.
    sinks : ndarray, shape (n_heads,), optional
        Per-query-head sink logits (``sink`` of :func:`tracesim.hajek_attention`).

    Returns
    -------
    OutputSpaceCertificate
    """
    qs = np.ascontiguousarray(queries, dtype=np.float64)
    ks = np.ascontiguousarray(keys, dtype=np.float64)
    vs = np.ascontiguousarray(values, dtype=np.float64)
    if qs.ndim != 3 or ks.ndim != 3 or vs.ndim != 3:
        raise ValueError("queries, keys and values must be 3-D (heads, tokens, dim)")
    n_heads, n_q, d = qs.shape
    n_kv, N, _ = ks.shape
    dv = vs.shape[2]
    if n_heads % n_kv:
        raise ValueError(f"{n_heads} query heads cannot share {n_kv} KV heads evenly")
    G = n_heads // n_kv
    pi = np.asarray(inclusion_probabilities, dtype=np.float64)
    keep = np.asarray(kept, dtype=bool)
    if pi.shape != (n_kv, N) or keep.shape != (n_kv, N):
        raise ValueError(f"inclusion_probabilities and kept must have shape ({n_kv}, {N})")
    w = _as_float64_2d("o_proj", o_proj, n_heads * dv)
    scale = d**-0.5 if scale is None else float(scale)
    qpos = (np.full(n_q, -1, dtype=np.int64) if query_positions is None
            else np.asarray(query_positions, dtype=np.int64).reshape(n_q))
    sink_row = (np.full(n_heads, NO_SINK) if sinks is None
                else np.asarray(sinks, dtype=np.float64).reshape(n_heads))
    rule, _ = logit_rule(scale, window, softcap, None)
    head_est = np.empty((n_heads, n_q, dv))
    group_var = np.empty((n_kv, n_q))
    for g in range(n_kv):
        # Validate this group's inputs through the public estimator (shapes, pi, visibility).
        for h in range(g * G, (g + 1) * G):
            hajek_attention(qs[h], ks[g], vs[g], pi[g], keep[g], scale=scale,
                            variance="trace", query_positions=qpos if query_positions is not None
                            else None, window=window, softcap=softcap,
                            sink=None if sinks is None else float(sink_row[h]))
        idx = np.flatnonzero(keep[g])
        block = w[:, g * G * dv:(g + 1) * G * dv]
        gram = np.ascontiguousarray(block.T @ block)
        est = np.empty((G, n_q, dv))
        kept_g = KeptTokens(np.ascontiguousarray(ks[g][idx]), np.ascontiguousarray(vs[g][idx]),
                            np.ascontiguousarray(pi[g][idx]), np.zeros(idx.size),
                            np.arange(N, dtype=np.int64)[idx])
        output_space_batch(np.ascontiguousarray(qs[g * G:(g + 1) * G]), qpos, kept_g, rule,
                           np.ascontiguousarray(sink_row[g * G:(g + 1) * G]), gram, est,
                           group_var[g])
        head_est[g * G:(g + 1) * G] = est
    output = np.einsum("hqd,ohd->qo", head_est, w.reshape(w.shape[0], n_heads, dv))
    return OutputSpaceCertificate(head_estimates=head_est, group_variance=group_var,
                                  variance_trace=group_var.sum(axis=0), output_estimate=output)
