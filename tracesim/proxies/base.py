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


__all__ = ["Proxy"]


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

    def _cached(self, trace: LayerTrace, kv_head: int, build):
        """Per-(trace, proxy, KV head) summary, built once (every step of a layer reuses it)."""
        key = ("proxy", self.spec(), int(kv_head))
        cache = trace._attention_cache
        if key not in cache:
            cache[key] = build()
        return cache[key]
