"""The shared plumbing of proxies: what a per-step design reads to guess each step's attention.

A *proxy* approximates the logits ``s_i = q . k_i * scale`` of the current decode query over the
cached keys ``[0, end)`` from a compact per-token summary held in fast memory (HBM), while the
full keys and values sit in a lower tier. A per-step design
(:class:`tracesim.policies.perstep.PerStepScore`) turns the proxy's softmax into inclusion
probabilities at every step, so the proxy decides the variance of the estimate, never its
validity.

Every proxy states its memory cost, :meth:`Proxy.bits_per_token`: bits per token per KV head
held besides the kept tokens; memory figures add it to the kept tokens' K/V bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar

import numpy as np

if TYPE_CHECKING:  # the policies import the proxies, not the other way round
    from tracesim.layer_trace import LayerTrace


__all__ = ["Proxy", "carry_summaries", "proxy_summaries"]


@dataclass(frozen=True)
class Proxy:
    """Base class of proxies (frozen dataclass; fields are hyperparameters).

    The fields are the spec's positional parameters, in order, and must be integers
    (``quant:4,32`` sets ``bits`` then ``group``); :meth:`spec` writes them back.

    Class attributes
    ----------------
    name : str
        Registry name (the part of the spec before ``:``).
    deployable : bool
        False for the ``exact`` reference, which reads every full key at every step.
    """

    name: ClassVar[str] = "proxy"
    deployable: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Subclass hook: raise ``ValueError`` on invalid hyperparameters."""

    def check_head_dim(self, head_dim: int) -> None:
        """Subclass hook: raise ``ValueError`` when the proxy cannot serve keys of
        ``head_dim`` dimensions (checked at planning, from ``model.json``, before any task)."""

    def check_trace(self, trace: LayerTrace) -> None:
        """Raise ``ValueError`` when the proxy cannot serve ``trace`` (default: its head
        dimension, :meth:`check_head_dim`)."""
        self.check_head_dim(int(trace.keys.shape[2]))

    def spec(self) -> str:
        """The spec string that :func:`tracesim.proxies.make_proxy` reads back.

        ``name`` or ``name:v1,v2,...`` (every field, in order); override it to leave out
        defaults.
        """
        values = [str(getattr(self, f.name)) for f in fields(self)]
        return self.name + (":" + ",".join(values) if values else "")

    def bits_per_token(self, head_dim: int) -> float:
        """Bits per token per KV head held in fast memory for this proxy."""
        raise NotImplementedError

    def logits(self, trace: LayerTrace, kv_head: int, queries: np.ndarray,
               end: int) -> np.ndarray:
        """Proxy logits of positions ``[0, end)`` for each query, shape ``(n, end)``, float64.

        Parameters
        ----------
        trace : LayerTrace
        kv_head : int
        queries : ndarray, shape (n, head_dim)
            The current decode query of each head of the KV head's group (post-RoPE).
        end : int
            Positions ``< end`` are cached (the query's own position is ``end``).
        """
        raise NotImplementedError

    def step_logits(self, trace: LayerTrace, kv_head: int, heads: list[int], query_index: int,
                    end: int) -> np.ndarray:
        """:meth:`logits` of the stored query ``query_index`` of ``heads`` at the step ``end``,
        shape ``(len(heads), end)``. A proxy whose keys stay the same over several steps may
        compute the coming steps' logits in one product (:class:`QuantProxy` does)."""
        return self.logits(trace, kv_head, trace.queries[heads, query_index], end)

    def extend(self, previous, trace: LayerTrace, kv_head: int):
        """Subclass hook: this KV head's summary of ``trace`` from ``previous``, the summary of
        the same layer at an earlier decode step, or None to rebuild it (the default).

        In the loop a decode step's trace is a new :class:`LayerTrace` whose cache appends to
        the previous step's: a proxy whose per-token summary does not depend on later tokens
        summarises only the appended positions (:func:`carry_summaries` hands it the previous
        summary). The result must equal the rebuilt summary.
        """
        return None

    def _cached(self, trace: LayerTrace, kv_head: int, build):
        """Per-(trace, proxy, KV head) summary, built once (every step of a layer reuses it),
        or extended from an earlier step's summary carried in by :func:`carry_summaries`."""
        key = ("proxy", self.spec(), int(kv_head))
        cache = trace._attention_cache
        if key not in cache:
            previous = cache.pop((_PREVIOUS, *key[1:]), None)
            summary = None if previous is None else self.extend(previous, trace, kv_head)
            cache[key] = build() if summary is None else summary
        return cache[key]


#: Cache-key tag of a summary carried from an earlier step (read once, then replaced).
_PREVIOUS = "proxy-previous"


def proxy_summaries(trace: LayerTrace) -> dict:
    """The proxy summaries ``trace`` has built, to carry to the next step's trace."""
    return {k: v for k, v in trace._attention_cache.items() if k[0] == "proxy"}


def carry_summaries(summaries: dict, trace: LayerTrace) -> None:
    """Offer ``summaries`` (from :func:`proxy_summaries` of the same layer at an earlier step,
    whose cached keys are a prefix of ``trace``'s) to ``trace``'s proxies: each proxy extends
    its own with :meth:`Proxy.extend` instead of rebuilding it."""
    for (_, spec, kv_head), summary in summaries.items():
        trace._attention_cache[(_PREVIOUS, spec, kv_head)] = summary
