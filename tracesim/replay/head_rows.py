"""One KV head's inclusion probabilities at one event, and many (event, KV head) rows at once.

:func:`head_inclusion` is the rule: take-all stratum, top-h of the tail, then the design's
probabilities for the rest. A per-step design applies it to every decode step of every KV head
(``steps x KV heads`` rows per layer); under Poisson capped PPS those rows are computed together
by :class:`StepRows`, compiled and in parallel
(:mod:`tracesim.kernels.step_inclusion`, the same values as the rule row by row).
"""

from __future__ import annotations

import numpy as np

from tracesim.designs import Design
from tracesim.designs.poisson import PoissonPPS
from tracesim.kernels.step_inclusion import ROW_OK, poisson_rows

__all__ = ["STEP_ROW_ENTRIES", "StepRows", "head_inclusion"]

#: Most score entries :class:`StepRows` holds before it computes them (32 MB of float64).
STEP_ROW_ENTRIES = 1 << 22


def _usable_scores(x: np.ndarray, n: int) -> np.ndarray:
    # Capped PPS cannot reach n with fewer than n positive scores (attention can underflow to
    # 0): lift zeros to a tiny fraction of the largest score so the budget stays reachable.
    if np.count_nonzero(x > 0) >= n:
        return x
    top = float(x.max()) if x.size else 0.0
    return np.full(x.size, 1.0) if top <= 0 else np.maximum(x, 1e-12 * top)


def _top_later(x: np.ndarray, h: int) -> np.ndarray:
    """Indices of the ``h`` largest of ``x`` (``0 < h < x.size``), the later position first
    among equal values (as TopK), in no particular order.

    The set a stable sort of the reversed scores selects, found in O(N): one partition gives
    the h-th largest value ``v``; every score above ``v`` is in, and of those equal to ``v``
    the last ones fill the remaining places.
    """
    v = np.partition(x, x.size - h)[x.size - h]
    above = np.flatnonzero(x > v)
    ties = np.flatnonzero(x == v)
    return np.concatenate([above, ties[ties.size - (h - above.size):]])


def head_inclusion(scores: np.ndarray, take_all: np.ndarray, design: Design,
                   tail_budget: int, top_fraction: float = 0.0,
                   alive: np.ndarray | None = None, ties: str = "later") -> np.ndarray:
    """Inclusion probabilities of positions ``[0, end)`` for one KV head at one event.

    Parameters
    ----------
    scores : ndarray, shape (end,)
        Non-negative scores.
    take_all : ndarray of bool, shape (end,)
        Sinks and window (``pi = 1``).
    design : Design
    tail_budget : int
        Expected number of tail tokens kept (top-h included).
    top_fraction : float
        Share of ``tail_budget`` given take-all to the highest tail scores (ties: later token).
    alive : ndarray of bool, shape (end,), optional
        Tokens still in the cache; evicted ones get ``pi = 0`` and no budget (deterministic
        decode-time eviction).
    ties : {"later", "earlier"}
        Which of equal scores a deterministic design and the top-h prefer (the score's
        ``ties``); randomized designs are not affected.

    Returns
    -------
    ndarray of float64, shape (end,)
    """
    if ties == "earlier" and not design.randomized:
        # Every rule here is position-symmetric except the tie order: run it on the reversed
        # positions, so "the later position" becomes the earlier one.
        return head_inclusion(scores[::-1], take_all[::-1], design, tail_budget, top_fraction,
                              None if alive is None else alive[::-1])[::-1].copy()
    if ties not in ("later", "earlier"):
        raise ValueError(f"ties = {ties!r}: expected 'later' or 'earlier'")
    end = scores.size
    pi = np.ones(end)
    tail = np.flatnonzero(~take_all if alive is None else (~take_all & alive))
    if alive is not None:
        pi[~alive & ~take_all] = 0.0
    n = min(int(tail_budget), tail.size)
    if n >= tail.size:
        return pi
    if n <= 0:
        pi[tail] = 0.0
        return pi
    x = np.asarray(scores, dtype=np.float64)[tail]
    h = int(round(float(top_fraction) * n))
    if h > 0:
        top = _top_later(x, h)
        keep = np.ones(tail.size, dtype=bool)
        keep[top] = False
        tail, x, n = tail[keep], x[keep], n - h
        if n <= 0:
            pi[tail] = 0.0
            return pi
        if n >= tail.size:
            return pi
    pi[tail] = design.inclusion_probabilities(_usable_scores(x, n), n)
    return pi


class StepRows:
    """Pending rows of a per-step design under :class:`PoissonPPS`, computed by
    :func:`tracesim.kernels.step_inclusion.poisson_rows` in batches of at most
    :data:`STEP_ROW_ENTRIES` positions and written into ``raw[e, g, :end]``; a row the kernel
    refuses (scores the design rejects) goes through :func:`head_inclusion`, which raises the
    error that names the problem."""

    def __init__(self, raw: np.ndarray, design: PoissonPPS, top_fraction: float) -> None:
        self.raw, self.design, self.top_fraction = raw, design, float(top_fraction)
        self._clear()

    def _clear(self) -> None:
        self.keys: list[tuple[int, int]] = []
        self.scores: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.first_alive: list[int] = []
        self.budgets: list[int] = []
        self.entries = 0

    def add(self, e: int, g: int, scores: np.ndarray, take_all: np.ndarray, first_alive: int,
            tail_budget: int) -> None:
        """Queue row ``(e, g)``: ``head_inclusion(scores, take_all, design, tail_budget,
        top_fraction, alive)`` with ``alive = arange(end) >= first_alive``."""
        self.keys.append((e, g))
        self.scores.append(np.asarray(scores, dtype=np.float64))
        self.masks.append(np.asarray(take_all, dtype=np.bool_))
        self.first_alive.append(int(first_alive))
        self.budgets.append(int(tail_budget))
        self.entries += self.scores[-1].size
        if self.entries >= STEP_ROW_ENTRIES:
            self.flush()

    def flush(self) -> None:
        """Compute the queued rows and write them into ``raw``."""
        if not self.keys:
            return
        sizes = np.array([x.size for x in self.scores], dtype=np.int64)
        offsets = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        pi, status = poisson_rows(np.concatenate(self.scores), offsets,
                                  np.concatenate(self.masks),
                                  np.array(self.first_alive, dtype=np.int64),
                                  np.array(self.budgets, dtype=np.int64), self.top_fraction,
                                  self.design.mixture, self.design.floor)
        for r, (e, g) in enumerate(self.keys):
            end = int(sizes[r])
            if status[r] == ROW_OK:
                self.raw[e, g, :end] = pi[offsets[r]:offsets[r + 1]]
            else:
                alive = np.arange(end) >= self.first_alive[r]
                self.raw[e, g, :end] = head_inclusion(
                    self.scores[r], self.masks[r], self.design, self.budgets[r],
                    self.top_fraction, None if self.first_alive[r] == 0 else alive)
        self._clear()
