"""Fetch schedulers: which evicted pages to bring back at one decode step of one layer.

Each scheduler turns what it may know at a step into a *priority* for every evicted page of
every KV head of the layer; the simulator then fetches pages in decreasing priority until the
step's byte budget is spent. All but ``oracle`` use only what a server has at that step.

* ``none``: nothing is fetched.
* ``random``: a permanent uniform per (seed, layer, KV head, step, page), stream 2.
* ``confidence``: random order; the step's byte budget is scaled by ``1 - exp(logprob)`` of the
  token the step reads (the last generated token), normalised so the budgets average to the
  others' over the sequence.
* ``certificate``: the KV head's certificate (sum over its query heads of ``tr V_hat``) times
  the page's share of the head's page bound (below). Needs a certified base policy.
* ``certificate_page``: the page's share of the certificate, i.e. the terms
  ``(1 - pi_i) a_i^2 |v_i - o_hat|^2`` of its *sampled* tokens summed over the group's query
  heads; pages without a sampled token follow in the ``certificate`` order. Needs a certified
  base policy.
* ``certificate_bound``: the page's share of the layer's certificate (its ``certificate_page``
  terms over their sum over every KV head of the layer) plus its share of the layer's page
  bound (its ``bound`` term over their sum). Needs a certified base policy.
* ``bound``: the page's term of the deterministic bound, summed over the group's query heads,
  ``n_p exp(u_p) (|c_p - o_R| + r_p) / E_R``.
* ``oracle`` (not deployable): the softmax mass the page adds when fetched, summed over the
  group's heads: its evicted tokens' true attention mass less ``(1/pi - 1)`` times the mass of
  its sampled tokens, whose Hájek weight already stood in for the page.

``u_p`` is the page's logit upper bound from its key summaries (``tracesim.bounds.pages``),
``c_p``, ``r_p`` its value centroid and radius, ``o_R`` and ``E_R`` the kept tokens' softmax
average and mass, all measured relative to the largest kept logit.
"""

from __future__ import annotations

import numpy as np

from tracesim.prn import permanent_uniforms

__all__ = ["BOUND_SCHEDULERS", "CERTIFIED_SCHEDULERS", "DEPLOYABLE", "SCHEDULERS",
           "STREAM_FETCH", "confidence_weights", "random_priority"]

SCHEDULERS = ("none", "random", "confidence", "certificate", "certificate_page", "bound",
              "oracle", "certificate_bound")
DEPLOYABLE = {s: s != "oracle" for s in SCHEDULERS}
#: Schedulers that read the certificate, so need a certified base policy.
CERTIFIED_SCHEDULERS = frozenset({"certificate", "certificate_page", "certificate_bound"})
#: Schedulers that read the page bound.
BOUND_SCHEDULERS = frozenset({"bound", "certificate", "certificate_page", "certificate_bound"})
#: Permanent-random-number stream of fetch orders (0: inclusion, 1: score perturbations).
STREAM_FETCH = 2


def random_priority(seed: int, layer: int, kv_head: int, step: int,
                    pages: np.ndarray) -> np.ndarray:
    """Permanent uniforms ordering the pages of one KV head at one step, shape (n_pages,)."""
    key = (np.int64(step) * 65537 + np.asarray(pages, dtype=np.int64)) % (1 << 32)
    return permanent_uniforms(int(seed), int(layer), int(kv_head), key, stream=STREAM_FETCH)


def confidence_weights(logprobs: np.ndarray) -> np.ndarray:
    """Per-step budget multipliers from the log-probs of the tokens the steps read.

    ``w = 1 - exp(logprob)`` (the chance the token just generated was not the model's sure
    pick), normalised to mean 1 over the steps; all-certain steps give uniform weights.

    Parameters
    ----------
    logprobs : ndarray, shape (n_steps,)
        Log-probabilities (<= 0); NaN where unknown (treated as the mean).

    Returns
    -------
    ndarray, shape (n_steps,)
    """
    lp = np.asarray(logprobs, dtype=np.float64)
    w = 1.0 - np.exp(np.minimum(lp, 0.0))
    if np.isnan(w).all():
        return np.ones(lp.size)
    w = np.where(np.isnan(w), np.nanmean(w), w)
    total = w.sum()
    return np.ones(lp.size) if total <= 0 else w * (w.size / total)
