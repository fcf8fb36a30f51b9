"""NVIDIA kvpress names: the presses ported as scores, aliases, and the budget convention.

kvpress's registry names resolve to tracesim scores (``make_score("streaming_llm")``, or
``score: observed_attention`` in a sweep spec); an alias may preset hyperparameters so that the
score behaves as the press does. kvpress's ``compression_ratio`` is the fraction of the KV pairs
removed, so ``budget = 1 - compression_ratio`` (see :func:`budget_from_compression_ratio`).
``docs/kvpress.md`` has the full table, including the presses that cannot be replayed.
"""

from __future__ import annotations

from typing import Any

from tracesim.policies.cur import CURScore
from tracesim.policies.expected_attention import ExpectedAttentionScore
from tracesim.policies.keydiff import KeyDiffScore
from tracesim.policies.lagkv import LagKVScore

__all__ = ["KVPRESS_ALIASES", "KVPRESS_SCORES", "budget_from_compression_ratio"]

#: kvpress scoring rules ported as tracesim scores (built-ins, one module each).
KVPRESS_SCORES = {cls.name: cls for cls in (KeyDiffScore, LagKVScore, CURScore,
                                            ExpectedAttentionScore)}

#: kvpress registry / class name -> (tracesim score, preset hyperparameters). kvpress names
#: equal to a tracesim score name (snapkv, tova, knorm, random, keydiff, lagkv, cur,
#: expected_attention) need no alias.
KVPRESS_ALIASES: dict[str, tuple[str, dict[str, Any]]] = {
    "streaming_llm": ("streaming", {"window": 0}),
    "observed_attention": ("h2o", {"normalize": True, "window": 0}),
    "StreamingLLMPress": ("streaming", {"window": 0}),
    "ObservedAttentionPress": ("h2o", {"normalize": True, "window": 0}),
    "SnapKVPress": ("snapkv", {"window": 64}),
    "TOVAPress": ("tova", {}),
    "KnormPress": ("knorm", {"window": 0}),
    "RandomPress": ("random", {}),
    "KeyDiffPress": ("keydiff", {}),
    "LagKVPress": ("lagkv", {}),
    "CURPress": ("cur", {}),
    "ExpectedAttentionPress": ("expected_attention", {}),
}


def budget_from_compression_ratio(ratio: float) -> float:
    """kvpress ``compression_ratio`` (fraction removed, in [0, 1)) -> tracesim fraction budget.

    Raises
    ------
    ValueError
        Outside ``[0, 1)`` (kvpress's own range).
    """
    r = float(ratio)
    if not 0.0 <= r < 1.0:
        raise ValueError(f"compression_ratio = {ratio}: expected a number in [0, 1)")
    return 1.0 - r
