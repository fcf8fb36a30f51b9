"""Per-step score: a proxy of the *current* decode query's attention, redrawn at every step."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score
from tracesim.proxies import make_proxy

__all__ = ["GQA_AGGREGATIONS", "PerStepScore"]

#: How the query heads of a GQA group are sampled: one sample shared by the group, from the
#: mean of their proxy attention or from the maximum (so each head's heavy tokens get a high
#: pi); or ``head``, one sample per query head from its own proxy attention (a reference: it
#: reads up to G times the rows of a shared sample).
GQA_AGGREGATIONS = ("mean", "max", "head")


#: Parsed proxies by spec (proxies are frozen: one instance serves every step and head).
_parsed_proxy = functools.lru_cache(maxsize=64)(make_proxy)


@dataclass(frozen=True)
class PerStepScore(Score):
    """Proxy attention of the decode query at the event's position (schedule ``step``).

    At the step whose query sits at position ``t`` the cache holds ``[0, t)`` (the token at
    ``t`` is always kept). For each query head ``h`` of the KV head's group, the proxy's logits
    ``s~_{h,i}`` over ``[0, t]`` (the current token's exact logit included) give the softmax
    ``a~_{h,i}``; the score of token ``i < t`` is their ``mean`` (or ``max``) over the group.
    With ``linearised`` it is multiplied by ``|v_i - o~_h|`` (mean over the group), the norm of
    the linearised variable of the Hájek estimator, with ``o~_h = sum_i a~_{h,i} v_i`` the
    proxy's own estimate (this reads every value: a reference for what the variable adds).

    With ``gqa = "head"`` every query head draws its own sample at every step, with ``pi``
    from its own ``a~_{h,i}`` (the proxy still summarises the keys of its KV head ``h // G``).
    The engine replays such a policy on the layer's per-query-head view
    (:meth:`~tracesim.layer_trace.LayerTrace.per_query_head`: ``n_kv = n_heads``), so
    :meth:`scores` is called with ``kv_head = h`` and the random numbers' head coordinate is
    the query head; kept tokens, budgets and rows read are then per query head (a KV head's
    group reads the sum of its ``G`` heads' rows). ``deployable`` is the proxy's: nothing a
    server lacks is read, but a shared sample reads up to ``G`` times fewer rows.

    The take-all stratum is the ``sinks`` first and ``window`` last positions before ``t`` plus
    the ``top_fraction`` share of the tail budget with the highest scores (the proxy's top-h);
    the design samples the rest. Whatever the proxy, the Hájek estimate with these ``pi`` is
    design-based at that step: a poor proxy costs variance, not validity.

    Parameters
    ----------
    proxy : str
        Proxy spec (:func:`tracesim.proxies.make_proxy`): ``exact``, ``quant:b``,
        ``lowrank:r``, ``pages:P``, ``simhash:K,L``.
    gqa : {"mean", "max", "head"}
        One sample per KV head from the group's mean (default) or maximum proxy attention, or
        one per query head (``head``; needs schedule ``step``, as every per-step score).
    linearised : bool, default False
    sinks, window, top_fraction
        Defaults 4, 32 and 0.5 (half the tail budget to the proxy's top tokens).

    Raises
    ------
    ValueError
        When the store holds no decode query at the event's position (a per-step design needs
        the query of every step it evaluates); with ``gqa = "head"``, when :meth:`scores` is
        given a stored layer whose group size exceeds 1 instead of its per-query-head view.
    """

    name: ClassVar[str] = "perstep"
    per_step: ClassVar[bool] = True
    transform: ClassVar[str] = "proxy attention mass (>= 0 as is)"

    proxy: str = "exact"
    gqa: str = "mean"
    linearised: bool = False
    top_fraction: float = 0.5

    def validate(self) -> None:
        object.__setattr__(self, "proxy", make_proxy(self.proxy).spec())
        if self.gqa not in GQA_AGGREGATIONS:
            raise ValueError(f"PerStepScore.gqa = {self.gqa!r}: expected one of "
                             f"{GQA_AGGREGATIONS}")
        if not isinstance(self.linearised, bool):
            raise ValueError(f"PerStepScore.linearised = {self.linearised!r}: expected a bool")

    @property
    def per_query_head(self) -> bool:  # type: ignore[override]
        return self.gqa == "head"

    @property
    def deployable(self) -> bool:  # type: ignore[override]
        return make_proxy(self.proxy).deployable and not self.linearised

    def proxy_bits(self, head_dim: int) -> float:
        """Bits per token per KV head the proxy holds in fast memory."""
        return make_proxy(self.proxy).bits_per_token(head_dim)

    def step_query(self, trace: LayerTrace, position: int) -> int:
        """Index of the stored decode query at ``position`` (the first, if several)."""
        # Every step of every KV head asks: the position -> index map is built once per trace.
        key = ("decode-query-at-position",)
        first = trace._attention_cache.get(key)
        if first is None:
            first = {}
            for i, (pos, role) in enumerate(zip(trace.query_positions.tolist(),
                                                trace.query_roles, strict=True)):
                if role == "decode":
                    first.setdefault(pos, i)
            trace._attention_cache[key] = first
        if position not in first:
            raise ValueError(f"perstep: sequence {trace.sequence_id!r} stores no decode query at "
                             f"position {position}; a per-step design needs a store captured "
                             "with decode steps (expected queries with role 'decode')")
        return first[position]

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        if self.gqa == "head" and trace.source is not None:
            # The per-query-head view: (view) KV head h is query head h of the stored layer,
            # whose proxy summarises the keys of its KV head h // G.
            src = trace.source
            return self._step_attention(src, kv_head // src.group_size, [kv_head], end)[0, :end]
        if self.gqa == "head" and trace.group_size > 1:
            raise ValueError(f"PerStepScore.gqa = 'head' draws one sample per query head: score "
                             f"the layer's per-query-head view (LayerTrace.per_query_head(), "
                             f"as the replay engine does), not a layer of "
                             f"{trace.group_size} query heads per KV head")
        heads = list(trace.group(kv_head))
        if trace.is_plain and not self.linearised:
            return self._plain_steps(trace, kv_head, heads, [end])[0]
        w = self._step_attention(trace, kv_head, heads, end)
        x = w.max(axis=0) if self.gqa == "max" else w.mean(axis=0)
        return x[:end]

    def step_scores(self, trace: LayerTrace, kv_head: int, ends: np.ndarray,
                    seed: int | None = None) -> list[np.ndarray]:
        """:meth:`scores` of every step of ``ends``: on a plain layer the logits of all the
        steps are laid end to end and their softmax rows reduced in one compiled call, in
        parallel over the steps (each step as :meth:`scores` computes it: the same values)."""
        if self.gqa == "head" or not trace.is_plain or self.linearised:
            return super().step_scores(trace, kv_head, ends, seed)
        return self._plain_steps(trace, kv_head, list(trace.group(kv_head)), ends)

    def _plain_steps(self, trace: LayerTrace, kv_head: int, heads: list[int],
                     ends) -> list[np.ndarray]:
        """The scores of ``heads`` at every step of ``ends`` on a plain layer, compiled: the
        steps' logits end to end, their softmax rows reduced in one call."""
        from tracesim.kernels.step_scores import group_softmax_steps

        ends = [int(t) for t in ends]
        n = len(heads)
        xoff = np.zeros(len(ends) + 1, dtype=np.int64)
        np.cumsum([t + 1 for t in ends], out=xoff[1:])
        s = np.empty(n * int(xoff[-1]))
        for i, t in enumerate(ends):
            self._step_logits(trace, kv_head, heads, t,
                              out=s[n * xoff[i]:n * xoff[i + 1]].reshape(n, t + 1))
        x = np.empty(int(xoff[-1]))
        group_softmax_steps(s, n * xoff, n, self.gqa == "max", x, xoff)
        return [x[xoff[i]:xoff[i] + t] for i, t in enumerate(ends)]

    def _step_logits(self, trace: LayerTrace, kv_head: int, heads: list[int],
                     end: int, out: np.ndarray | None = None) -> np.ndarray:
        """Proxy logits of ``heads`` at the step ``end`` over positions ``[0, end]`` (the
        current token last, exact), shape (len(heads), end + 1); into ``out`` if given."""
        proxy = _parsed_proxy(self.proxy)
        proxy.check_trace(trace)
        qi = self.step_query(trace, end)
        q = trace.queries[heads, qi]  # (n, d)
        s = np.empty((len(heads), end + 1)) if out is None else out
        s[:, :end] = proxy.step_logits(trace, kv_head, heads, qi, end)
        s[:, end] = (q @ trace.keys[kv_head, end]) * trace.scale  # the current token: exact
        return s

    def _step_attention(self, trace: LayerTrace, kv_head: int, heads: list[int],
                        end: int) -> np.ndarray:
        """Proxy softmax of ``heads`` (query heads of ``kv_head``) at the step ``end``, times
        ``|v_i - o~_h|`` when ``linearised``; positions ``[0, end]`` (the current token last),
        shape (len(heads), end + 1)."""
        s = self._step_logits(trace, kv_head, heads, end)
        if trace.is_plain:
            w = np.exp(s - s.max(axis=1, keepdims=True))
            w /= w.sum(axis=1, keepdims=True)
        else:
            w = _variant_softmax(trace, heads, s, end)
        if self.linearised:
            V = trace.values[kv_head, :end + 1]
            o = w @ V  # (n, d)
            w = w * np.linalg.norm(V[None] - o[:, None], axis=2)
        return w


def _variant_softmax(trace: LayerTrace, heads: list[int], s: np.ndarray, end: int
                     ) -> np.ndarray:
    """The proxy softmax of a sliding, soft-capped or sink layer, as the model forms it:
    logits capped, positions before the window ``(end - w, end]`` at 0, each head's sink in
    the denominator (a share no token gets)."""
    s = trace.logits(s / trace.scale)
    if trace.window is not None:
        s[:, :max(0, end - trace.window + 1)] = -np.inf
    top = s.max(axis=1, keepdims=True)
    sinks = (np.full((len(heads), 1), -np.inf) if trace.sinks is None
             else trace.sinks[heads][:, None])
    top = np.maximum(top, sinks)
    w = np.exp(s - top)
    return w / (w.sum(axis=1, keepdims=True) + np.exp(sinks - top))
