"""When eviction happens: one-shot compression after prefill, or every k decode steps.

An *event* at time ``tau`` compresses the tokens at positions ``< tau``; later tokens are kept
(``pi = 1``) until the next event. A query at position ``t`` sees the cache of the last event
with ``tau <= t``; a query earlier than every event (a question-window query when the store has
no decode queries) is evaluated on the first event's cache, as if it had been computed after
compression.

Decode-time eviction uses the nested permanent-random-number rule: token i is kept at event e
while ``u_i < min_{e' <= e} pi_i(e')``, so its effective inclusion probability is the running
minimum of its probabilities — still a Poisson design, with that minimum as ``pi`` in the
Hájek estimator. Deterministic designs (``pi`` in {0, 1}) reduce to "once evicted, gone".

Per-step designs (``step``) draw a new sample at *every* evaluated decode query: the whole cache
stays in a lower tier, and the query at position ``t`` attends to the tokens of ``[0, t)`` kept
by a design whose inclusion probabilities come from a proxy of that very query
(:class:`tracesim.policies.perstep.PerStepScore`); the token at ``t`` itself is always kept.
Nothing is nested: each step's ``pi`` is its own. ``coordination`` says which uniforms decide
the kept set: ``fresh`` draws them anew at every step (stream
:func:`tracesim.prn.step_stream` of the query position: independent samples), ``permanent``
uses the same uniforms (stream 0) at every step (positively coordinated samples: fewer
distinct tokens read over a generation, still a Poisson design at each step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["COORDINATIONS", "SCHEDULES", "Schedule", "event_of_queries", "nested_inclusion"]

SCHEDULES = ("oneshot", "decode", "step")
#: Uniforms of per-step designs: redrawn at every step, or the same at every step.
COORDINATIONS = ("fresh", "permanent")


@dataclass(frozen=True)
class Schedule:
    """Eviction schedule.

    Parameters
    ----------
    kind : {"oneshot", "decode", "step"}
        ``oneshot``: one event after prefill (at the end of the compressible range);
        ``decode``: that event, then one every ``every`` decode steps; ``step``: one event at
        every evaluated query, from a proxy of that query (a per-step design).
    every : int, default 16
        Decode steps between events (``decode`` only).
    coordination : {"fresh", "permanent"}, default "fresh"
        Uniforms of a ``step`` schedule (see the module docstring); ignored otherwise.
    """

    kind: str = "oneshot"
    every: int = 16
    coordination: str = "fresh"

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"Schedule.kind = {self.kind!r}: expected one of {SCHEDULES}")
        if isinstance(self.every, bool) or not isinstance(self.every, (int, np.integer)) \
                or self.every < 1:
            raise ValueError(f"Schedule.every = {self.every!r}: expected an int >= 1")
        if self.coordination not in COORDINATIONS:
            raise ValueError(f"Schedule.coordination = {self.coordination!r}: expected one of "
                             f"{COORDINATIONS}")
        if self.kind != "step":
            object.__setattr__(self, "coordination", "fresh")  # one id per schedule

    @property
    def per_step(self) -> bool:
        """Whether every evaluated query is its own event (a per-step design)."""
        return self.kind == "step"

    @property
    def fresh(self) -> bool:
        """Whether a per-step schedule redraws its uniforms at every step."""
        return self.per_step and self.coordination == "fresh"

    def label(self) -> str:
        if self.kind == "step":
            return f"step({self.coordination})"
        return "oneshot" if self.kind == "oneshot" else f"decode(every={int(self.every)})"

    def params(self) -> dict[str, object]:
        """The schedule as a plain dict (``coordination`` only for ``step``, so the ids and
        JSON of the other schedules are those of earlier versions)."""
        out: dict[str, object] = {"kind": self.kind, "every": int(self.every)}
        if self.kind == "step":
            out["coordination"] = self.coordination
        return out

    def event_times(self, compress_end: int, prompt_length: int, last_query: int,
                    query_positions: np.ndarray | None = None) -> np.ndarray:
        """Event times ``tau`` (int64, increasing).

        Parameters
        ----------
        compress_end : int
            End of the range compressed after prefill (the first event).
        prompt_length : int
        last_query : int
            Position of the last evaluated query; no event is placed after it.
        query_positions : ndarray of int64, optional
            Evaluated query positions; required by ``step`` (one event at each).
        """
        first = int(compress_end)
        if self.kind == "step":
            if query_positions is None:
                raise ValueError("a step schedule needs the evaluated query positions")
            return np.unique(np.asarray(query_positions, dtype=np.int64))
        if self.kind == "oneshot":
            return np.array([first], dtype=np.int64)
        later = np.arange(prompt_length + self.every, last_query + 1, self.every,
                          dtype=np.int64)
        return np.concatenate(([first], later[later > first]))


def event_of_queries(times: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Index of the last event with ``tau <= position`` (0 when the query precedes them all)."""
    idx = np.searchsorted(np.asarray(times), np.asarray(positions), side="right") - 1
    return np.maximum(idx, 0)


def nested_inclusion(per_event: np.ndarray) -> np.ndarray:
    """Effective inclusion probabilities: the running minimum over events, shape unchanged.

    Parameters
    ----------
    per_event : ndarray, shape (n_events, P)
        Inclusion probabilities computed afresh at each event (1 for tokens not yet compressed).
    """
    return np.minimum.accumulate(np.asarray(per_event, dtype=np.float64), axis=0)
