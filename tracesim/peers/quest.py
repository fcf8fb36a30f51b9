"""Quest (arXiv 2406.10774), replayed as its evaluation code selects pages.

Read from ``mit-han-lab/Quest`` (``evaluation/quest_attention.py``, the path behind its
accuracy tables): pages of ``page`` = 16 positions from position 0 over the whole cache
(``N = t + 1`` keys, the last page possibly partial); per query head the page bound
``U_p = sum_c max(q_c min_c, q_c max_c)`` from the page's elementwise key minimum and maximum;
the top ``min(max(3, budget // page), n_pages)`` pages by ``U_p`` (``budget`` in tokens,
``min(N, budget)``); plain softmax over their tokens; no page forced, no reweighting;
deterministic. Quest keeps its first two layers dense (replay them with ``full`` if you want
that). Ties between equal bounds go to the earlier page (``numpy`` stable sort; torch's
``topk`` does not specify).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.peers.base import Peer, StepInput, hajek_step_metrics
from tracesim.proxies.pages import page_upper_bounds

__all__ = ["Quest"]


@dataclass(frozen=True)
class Quest(Peer):
    """Quest's top-k pages; see the module docstring.

    Parameters
    ----------
    page : int
        Positions per page (16).
    budget : float
        Token budget per step: a fraction of the step's cache when <= 1, else tokens.
    """

    name: ClassVar[str] = "quest"
    randomized: ClassVar[bool] = False

    page: int = 16
    budget: float = 0.25

    def __post_init__(self) -> None:
        self._check_ints(1, "page")
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)):
            raise ValueError(f"quest: budget = {self.budget!r}: expected a number (a fraction "
                             "in (0, 1] or a token count)")
        object.__setattr__(self, "budget", float(self.budget))
        if not (np.isfinite(float(self.budget)) and float(self.budget) > 0):
            raise ValueError(f"quest: budget = {self.budget!r}: expected a fraction in (0, 1] "
                             "or a token count")

    def label(self) -> str:
        return f"quest(page={self.page},budget={self.budget:g})"

    def selected_pages(self, x: StepInput) -> np.ndarray:
        n = x.step + 1
        tokens = int(round(self.budget * n)) if self.budget <= 1 else int(self.budget)
        tokens = min(n, tokens)
        bounds = page_upper_bounds(x.query[None], x.keys, self.page)[0]
        k = min(max(3, tokens // self.page), bounds.size)
        return np.sort(np.argsort(-bounds, kind="stable")[:k])

    def attend(self, x: StepInput, state, seed: int, z: float):
        n = x.step + 1
        kept = np.zeros(n, dtype=bool)
        for p in self.selected_pages(x):
            kept[p * self.page:(p + 1) * self.page] = True
        row = hajek_step_metrics(x, np.ones(n), kept, z, correction=False)
        row.update(kept_tokens=int(kept.sum()), sampled=0, expected_sampled=0.0,
                   peer_bound_ok=float("nan"))
        return row, row["estimate"], kept
