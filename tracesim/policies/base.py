"""The shared plumbing of scores: validated hyperparameters, the take-all stratum, labels.

A *score* ranks the tokens of the compressible range ``[0, end)`` of one KV head; a *design*
(:mod:`tracesim.designs`) turns the tail's scores and a budget into inclusion probabilities; a
*correction* decides whether the Hájek offset ``-log pi`` is applied. The three are orthogonal.

Every score keeps a take-all stratum (``pi = 1``): the first ``sinks`` positions, the last
``window`` positions before ``end``, and optionally the top ``top_fraction`` of the tail budget
by score (applied by the replay engine once the budget is known). Everything else is the tail.

Designs need non-negative scores; each subclass documents its transform in ``transform``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import numpy as np

from tracesim.layer_trace import LayerTrace

__all__ = ["Score", "take_all_mask"]


def take_all_mask(end: int, sinks: int, window: int) -> np.ndarray:
    """Boolean mask over ``[0, end)``: the first ``sinks`` and the last ``window`` positions."""
    mask = np.zeros(end, dtype=bool)
    mask[:min(sinks, end)] = True
    if window > 0:
        mask[max(0, end - window):] = True
    return mask


def _format(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


@dataclass(frozen=True)
class Score:
    """Base class of scores (frozen dataclass; fields are hyperparameters).

    Parameters
    ----------
    sinks : int
        Leading positions always kept (attention sinks).
    window : int
        Trailing positions of the compressible range always kept (recent / observation window).
    top_fraction : float in [0, 1]
        Share of the tail budget given, take-all, to the highest-scoring tail tokens.

    Class attributes
    ----------------
    name : str
        Registry name.
    seed_dependent : bool
        The score itself is random (drawn from permanent uniforms of stream 1), so inclusion
        probabilities are recomputed per seed.
    default_correction : {"hajek", "none"}
        Correction used when a policy asks for ``"auto"``.
    evicts : bool
        False only for ``full`` (no eviction).
    deployable : bool
        False for reference scores that read what a server cannot know when it evicts (the
        ``oracle`` reads the future decode queries); reported in the ``deployable`` column.
    transform : str
        How raw importance becomes a non-negative score (documentation).
    per_step : bool
        The score reads the query of the step it is evaluated at (per-step designs, schedule
        ``step``); every other score is computed at eviction events from what exists then.
    ties : {"later", "earlier"}
        Which of two equal scores a deterministic design (``topk``) prefers: the later position
        (tracesim's rule) or the earlier one (the kvpress presses, as ``torch.topk`` on CUDA).
    truncate_stratum : bool
        A budget below the take-all stratum keeps only its earliest ``budget`` tokens (the
        kvpress presses, which protect by score); otherwise the whole stratum is kept.
    per_query_head : bool
        The score draws one sample per *query* head (``perstep`` with ``gqa: head``): the
        engine replays it on :meth:`LayerTrace.per_query_head`, where ``kv_head`` is the
        query head. Every other score draws one sample per KV head, shared by its group.
    """

    name: ClassVar[str] = "score"
    seed_dependent: ClassVar[bool] = False
    default_correction: ClassVar[str] = "hajek"
    evicts: ClassVar[bool] = True
    deployable: ClassVar[bool] = True
    transform: ClassVar[str] = ""
    per_step: ClassVar[bool] = False
    ties: ClassVar[str] = "later"
    truncate_stratum: ClassVar[bool] = False
    per_query_head: ClassVar[bool] = False

    sinks: int = 4
    window: int = 32
    top_fraction: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(
                    value, (int, np.integer))):
                raise ValueError(f"{type(self).__name__}.{f.name} = {value!r}: expected an int")
        if self.sinks < 0 or self.window < 0:
            raise ValueError(f"{type(self).__name__}: sinks and window must be >= 0")
        if not 0.0 <= float(self.top_fraction) <= 1.0:
            raise ValueError(
                f"{type(self).__name__}.top_fraction = {self.top_fraction}: expected [0, 1]")
        self.validate()

    def validate(self) -> None:
        """Subclass hook: raise ``ValueError`` on invalid hyperparameters."""

    # -- what the engine calls -------------------------------------------------------------
    def compress_end(self, trace: LayerTrace) -> int:
        """End of the range compressed by one-shot compression after prefill (default: prompt)."""
        return trace.prompt_length

    def take_all(self, trace: LayerTrace, kv_head: int, end: int) -> np.ndarray:
        """Take-all mask over ``[0, end)`` (sinks and window; top-h is added by the engine)."""
        return take_all_mask(end, self.sinks, self.window)

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        """Non-negative scores of positions ``[0, end)`` for ``kv_head``, shape (end,), float64.

        ``end`` is the event time: tokens at positions ``< end`` exist and may be evicted.
        ``seed`` is given only to seed-dependent scores.
        """
        raise NotImplementedError

    def step_scores(self, trace: LayerTrace, kv_head: int, ends: np.ndarray,
                    seed: int | None = None) -> list[np.ndarray]:
        """:meth:`scores` at every event time of ``ends``, in order (a per-step score computes
        many steps together where it can; the values are those of :meth:`scores`)."""
        return [self.scores(trace, kv_head, int(t), seed) for t in ends]

    def tail_budgets(self, trace: LayerTrace, tail_scores: list[np.ndarray], tail_budget: int,
                     budget: Any) -> np.ndarray:
        """Per-KV-head tail budgets of one event: the budget's allocator by default
        (:meth:`tracesim.budgets.Budget.allocate`); a score that sets them itself (head roles)
        overrides this."""
        return budget.allocate(tail_scores, tail_budget)

    def check_budget(self, budget: Any) -> None:
        """Subclass hook: raise ``ValueError`` if this score cannot use ``budget`` (called when
        a policy is built, so a spec fails before any work)."""

    def kept_tokens(self, budget: object, context: int) -> int:
        """Nominal tokens per (layer, KV head) for a compressible range of ``context`` tokens.

        ``budget.tokens(context)`` (a fraction rounds to the nearest token); the kvpress presses
        truncate instead (:mod:`tracesim.policies.kvpress`).
        """
        return int(budget.tokens(context))  # type: ignore[attr-defined]

    # -- identity ----------------------------------------------------------------------------
    def params(self) -> dict[str, object]:
        """Hyperparameters as a plain dict (field order)."""
        return asdict(self)

    def label(self) -> str:
        """Stable string id, e.g. ``snapkv(window=32,kernel=5,...)``."""
        inner = ",".join(f"{k}={_format(v)}" for k, v in self.params().items())
        return f"{self.name}({inner})"

    def specific_params_json(self) -> str:
        """Score-specific hyperparameters (not sinks/window/top_fraction) as sorted JSON."""
        p = {k: v for k, v in self.params().items()
             if k not in ("sinks", "window", "top_fraction")}
        return json.dumps(p, sort_keys=True)
