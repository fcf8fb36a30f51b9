"""Quest (arXiv 2406.10774), replayed as its evaluation code selects pages.

Read from ``mit-han-lab/Quest`` (``evaluation/quest_attention.py``, the path behind its
accuracy tables): pages of ``page`` = 16 positions from position 0 over the whole cache
(``N = t + 1`` keys, the last page possibly partial); per query head the page bound
``U_p = sum_c max(q_c min_c, q_c max_c)`` from the page's elementwise key minimum and maximum;
the top ``min(max(3, tokens // page), n_pages)`` pages by ``U_p``; plain softmax over their
tokens; no page forced, no reweighting; deterministic. The token budget is read as
``xAlg-ai/sparse-attention-hub``'s ``QuestTopKMasker`` reads its ``heavy_size``: a float is a
fraction, ``tokens = int(budget N)`` (truncated, not rounded), an integer is a count; when
``N <= max(1, tokens)`` the step attends every token (the hub's switch to full attention).
On a sliding layer (``docs/peers.md``, "Attention variants") ``N`` is the window the layer
holds and the pages keep their absolute boundaries, the oldest one clipped to the window (as a
paged cache frees whole pages behind a sliding window); soft-capping is monotone, so it leaves
the page order unchanged and enters only the softmax, and a learned sink enters its denominator.
Quest keeps its first two layers dense (replay them with ``full`` if you want that). Ties
between equal bounds go to the earlier page (``numpy`` stable sort; torch's ``topk`` does not
specify).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.peers.base import (
    Peer,
    StepInput,
    effective_size,
    hajek_step_metrics,
    hub_size,
    size_label,
)
from tracesim.proxies.pages import page_upper_bounds

__all__ = ["Quest"]


@dataclass(frozen=True)
class Quest(Peer):
    """Quest's top-k pages; see the module docstring.

    Parameters
    ----------
    page : int
        Positions per page (16).
    budget : float or int
        Token budget per step: a float is a fraction in (0, 1] of the step's cache
        (``int(budget N)`` tokens), an int a token count (see :func:`quest_tokens`).
    """

    name: ClassVar[str] = "quest"
    randomized: ClassVar[bool] = False

    page: int = 16
    budget: float | int = 0.25

    def __post_init__(self) -> None:
        self._check_ints(1, "page")
        object.__setattr__(self, "budget", hub_size(self.budget, "quest: budget", 1))

    def label(self) -> str:
        return f"quest(page={self.page},budget={size_label(self.budget)})"

    def selected_pages(self, x: StepInput) -> np.ndarray:
        """Indices of the chosen pages among those the layer holds, counted from the page of
        position ``x.start`` (page ``j`` covers positions ``[(f + j) page, (f + j + 1) page)``
        with ``f = x.start // page``, clipped to what the layer holds)."""
        n = x.n
        tokens = effective_size(self.budget, n)
        lead = x.start % self.page
        # the first held page may begin before the window: repeating its first held key does
        # not change its min/max, and keeps the pages aligned on absolute positions
        keys = x.keys if lead == 0 else np.concatenate([np.repeat(x.keys[:1], lead, axis=0),
                                                        x.keys])
        bounds = page_upper_bounds(x.query[None], keys, self.page)[0]
        if n <= max(1, tokens):  # the hub attends every token
            return np.arange(bounds.size)
        k = max(1, min(bounds.size, max(3, tokens // self.page)))
        return np.sort(np.argsort(-bounds, kind="stable")[:k])

    def attend(self, x: StepInput, state, seed: int, z: float):
        n = x.n
        lead = x.start % self.page
        kept = np.zeros(n, dtype=bool)
        for p in self.selected_pages(x):
            kept[max(0, p * self.page - lead):(p + 1) * self.page - lead] = True
        row = hajek_step_metrics(x, np.ones(n), kept, z, correction=False)
        row.update(kept_tokens=int(kept.sum()), sampled=0, expected_sampled=0.0,
                   peer_bound_ok=float("nan"))
        return row, row["estimate"], kept
