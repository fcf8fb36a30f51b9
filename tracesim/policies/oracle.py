"""Oracle: the evaluated decode queries' own full-cache attention (a reference, not deployable)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score

__all__ = ["OracleScore"]


@dataclass(frozen=True)
class OracleScore(Score):
    """Mean full-cache attention of every stored ``decode`` query, over the GQA group.

    ``x_i`` is the post-softmax attention key ``i`` receives from the decode-step queries (role
    ``decode``, positions ``>= prompt_length``: the queries the replay evaluates by default),
    averaged over the query heads of the KV head's group and over those queries. It reads
    queries that come *after* the eviction event, which no server can know when it evicts, so
    it is a reference upper bound on what a score can foresee: ``deployable = False`` (the
    ``deployable`` result column). It separates estimator failure (the certificate misses even
    with a score that knows the queries) from score failure (a deployable score that does not
    foresee later queries). Under ``decode:K`` every event reads all decode queries, future ones
    included.

    Parameters
    ----------
    sinks, window, top_fraction
        As for every score (defaults 4, 32, 0: the same take-all stratum as SnapKV, so the two
        compare at equal memory).

    Raises
    ------
    ValueError
        When the sequence stores no ``decode`` query (naming the sequence).
    """

    name: ClassVar[str] = "oracle"
    deployable: ClassVar[bool] = False
    transform: ClassVar[str] = "attention mass (>= 0 as is)"

    window: int = 32

    def decode_queries(self, trace: LayerTrace) -> np.ndarray:
        """Indices of the stored ``decode`` queries (all of them, whatever the event)."""
        idx = trace.role_indices("decode")
        if idx.size == 0:
            raise ValueError(f"oracle: sequence {trace.sequence_id!r} stores no query with "
                             "role 'decode' (the oracle scores with the decode queries' own "
                             "attention; capture decode steps or use another score)")
        return idx

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        return trace.group_attention(kv_head, self.decode_queries(trace))[:end]
