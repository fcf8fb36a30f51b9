"""A base score inside another score: VaSE and head roles rank tokens with a chosen score."""

from __future__ import annotations

from functools import lru_cache

from tracesim.policies.base import Score

__all__ = ["base_score"]

#: Scores that wrap a base score cannot take one another (or themselves) as their base.
WRAPPERS = ("vase", "headroles", "tangram")


@lru_cache(maxsize=64)
def base_score(owner: str, name: str, sinks: int, window: int) -> Score:
    """The base score ``name`` with the wrapper's ``sinks`` and ``window``, its other
    hyperparameters at their defaults.

    The base must be a deterministic, one-shot/decode score of the registry (no per-step, no
    per-query-head, no random score, not ``full``), so that the wrapper alone decides what is
    random. Raises ``ValueError`` naming the wrapper's field otherwise.
    """
    from tracesim.registry import SCORE_REGISTRY

    if not isinstance(name, str) or name in WRAPPERS:
        raise ValueError(f"{owner}.base = {name!r}: expected the name of a plain score "
                         f"(e.g. 'h2o', 'snapkv', 'tova', 'knorm'), not {list(WRAPPERS)}")
    try:
        score = SCORE_REGISTRY.build(name, {"sinks": sinks, "window": window})
    except (KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"{owner}.base = {name!r}: {exc}") from None
    if (not score.evicts or score.per_step or score.per_query_head or score.seed_dependent
            or not score.deployable):
        raise ValueError(f"{owner}.base = {name!r}: expected a deterministic, deployable "
                         f"score read at eviction events (not full, random, keyformer, "
                         f"perstep or oracle)")
    return score
