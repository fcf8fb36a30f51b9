"""Head roles (DuoAttention-style): retrieval heads keep the cache, streaming heads keep sinks
and a recent window.

Source: Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and
Streaming Heads", arXiv 2410.10819 (2024): a share of the heads (retrieval heads) need the
whole context; the others (streaming heads) need only the attention sinks and the recent
tokens, and get a constant-size cache. DuoAttention *learns* each head's role (a gate trained
on synthetic retrieval data, then thresholded); Forcing-KV (cited in the project seed) prunes
per head by role as well. tracesim has no training loop: it classifies each KV head from the
prefill with an attention-mass statistic instead (issue #33), documented in docs/scores.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from tracesim.budgets import role_allocation
from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score
from tracesim.policies.composed import base_score

__all__ = ["HeadRolesScore", "long_range_mass"]


def long_range_mass(trace: LayerTrace, kv_head: int, end: int, sinks: int,
                    window: int) -> float:
    """Mean attention mass the stored prefill queries of the group put beyond sinks and window.

    For every stored query at a position ``p < end`` (the prefill: ``end`` is the end of the
    compressed range) and every query head of the group: the attention on keys
    ``[sinks, p + 1 - window)``, i.e. what a streaming cache of ``sinks`` + ``window`` tokens
    would lose at that query. Mean over queries and heads. Raises ``ValueError`` naming the
    sequence when no prefill query is stored.
    """
    idx = trace.indices_before(end)
    if idx.size == 0:
        raise ValueError(f"headroles: sequence {trace.sequence_id!r} stores no prefill query "
                         f"before position {end}; capture with a --window of at least 1")
    total, n = 0.0, 0
    for h in trace.group(kv_head):
        for i in idx:
            p = int(trace.query_positions[i])
            hi = p + 1 - window
            row = trace.attention(h, int(i))
            total += float(row[sinks:hi].sum()) if hi > sinks else 0.0
            n += 1
    return total / n


@dataclass(frozen=True)
class HeadRolesScore(Score):
    """Per-KV-head roles from the prefill; role budgets instead of one budget for all heads.

    A KV head is a *retrieval* head when :func:`long_range_mass` (its group's prefill
    attention beyond ``sinks`` + ``window``) is at least ``threshold``, else a *streaming*
    head. Every head keeps ``sinks`` and ``window`` take-all. A retrieval head's tail budget is
    the policy's (budget ``1.0``: the whole cache, DuoAttention's full attention; a smaller one
    samples or ranks its tail by the ``base`` score under the policy's design); a streaming
    head keeps ``streaming_tail`` tail tokens (0: exactly sinks + recent window, as
    DuoAttention; > 0: a small tail drawn by the same design, so the head's error is certified
    under a Poisson design). Roles are fixed at the end of the compressed range and kept at
    every later event.

    Parameters
    ----------
    base : str, default "h2o"
        Registry name of the score that ranks (or, under a randomized design, samples) tails.
    threshold : float in [0, 1], default 0.3
        Long-range attention mass from which a head is a retrieval head.
    streaming_tail : int >= 0, default 0
        Tail tokens of a streaming head beyond its sinks and window.
    """

    name: ClassVar[str] = "headroles"
    transform: ClassVar[str] = "the base score (>= 0 as is); per-head budgets by role"

    window: int = 32
    base: str = "h2o"
    threshold: float = 0.3
    streaming_tail: int = 0

    def validate(self) -> None:
        if not 0.0 <= float(self.threshold) <= 1.0:
            raise ValueError(f"HeadRolesScore.threshold = {self.threshold}: expected [0, 1]")
        if self.streaming_tail < 0:
            raise ValueError(f"HeadRolesScore.streaming_tail = {self.streaming_tail}: "
                             f"expected an int >= 0")
        self.base_score()

    def base_score(self) -> Score:
        """The base score (the registry's, with this score's sinks and window)."""
        return base_score("HeadRolesScore", self.base, int(self.sinks), int(self.window))

    def compress_end(self, trace: LayerTrace) -> int:
        return self.base_score().compress_end(trace)

    def retrieval_heads(self, trace: LayerTrace) -> np.ndarray:
        """Bool per KV head: True for a retrieval head (classified on the prefill)."""
        end = self.compress_end(trace)
        return np.array([long_range_mass(trace, g, end, int(self.sinks), int(self.window))
                         >= float(self.threshold) for g in range(trace.n_kv_heads)])

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        return self.base_score().scores(trace, kv_head, end)

    def check_budget(self, budget: Any) -> None:
        if budget.allocator != "uniform":
            raise ValueError(f"headroles sets each head's budget by its role; the budget's "
                             f"allocator is {budget.allocator!r}, expected 'uniform'")

    def tail_budgets(self, trace: LayerTrace, tail_scores: list[np.ndarray], tail_budget: int,
                     budget: Any) -> np.ndarray:
        self.check_budget(budget)
        return role_allocation(self.retrieval_heads(trace),
                               np.array([s.size for s in tail_scores], dtype=np.int64),
                               tail_budget, int(self.streaming_tail))
