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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SCHEDULES", "Schedule", "event_of_queries", "nested_inclusion"]

SCHEDULES = ("oneshot", "decode")


@dataclass(frozen=True)
class Schedule:
    """Eviction schedule.

    Parameters
    ----------
    kind : {"oneshot", "decode"}
        ``oneshot``: one event after prefill (at the end of the compressible range);
        ``decode``: that event, then one every ``every`` decode steps.
    every : int, default 16
        Decode steps between events (``decode`` only).
    """

    kind: str = "oneshot"
    every: int = 16

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"Schedule.kind = {self.kind!r}: expected one of {SCHEDULES}")
        if isinstance(self.every, bool) or not isinstance(self.every, (int, np.integer)) \
                or self.every < 1:
            raise ValueError(f"Schedule.every = {self.every!r}: expected an int >= 1")

    def label(self) -> str:
        return "oneshot" if self.kind == "oneshot" else f"decode(every={int(self.every)})"

    def event_times(self, compress_end: int, prompt_length: int, last_query: int) -> np.ndarray:
        """Event times ``tau`` (int64, increasing).

        Parameters
        ----------
        compress_end : int
            End of the range compressed after prefill (the first event).
        prompt_length : int
        last_query : int
            Position of the last evaluated query; no event is placed after it.
        """
        first = int(compress_end)
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
