"""Conf-KV (Li & Miao, arXiv 2605.24786): a per-step cache budget set by the model's confidence.

Conf-KV turns the next-token distribution into a scalar confidence and uses it to set the cache
budget of the next decode step: a confident step keeps little, an uncertain one keeps more.
Within the budget, tokens are ranked by a composite of accumulated attention mass and recency,
and a protected recent window is always kept. The paper's method section (its exact formulas
and default hyperparameters) could not be read here and its code is not public ("released upon
acceptance"); the rule below follows the abstract and public summaries of the paper, and every
formula and default in it is this module's choice (``docs/evict.md``, "Conf-KV"):

* confidence ``c = (1 - H(p)/log V + p_1 + 1 - p_2/p_1) / 3`` over the next-token
  probabilities ``p`` (``V`` tokens, ``p_1 >= p_2`` the two largest): normalised entropy,
  top-1 mass and the top-1/top-2 margin, each in ``[0, 1]``;
* budget share ``b = budget_max - c (budget_max - budget_min)`` of what the layer holds at that
  step (the tokens of ``[0, t)`` a full layer sees, those of its window on a sliding layer);
  kept tokens ``k = min(n, max(round(b n), protected))``;
* rank ``s_i = alpha A_i / max_j A_j + (1 - alpha) r_i`` with ``A`` the accumulated attention
  mass (an exponential moving average, decay ``ema``, of the attention the token receives at
  each decode step, mean over the KV head's query heads; prompt tokens start from their mean
  prefill attention) and ``r_i = (i - lo + 1)/n`` the linear recency over the population
  ``[lo, t)``;
* eviction is permanent, as in a cache manager: when a layer holds more than ``k`` tokens, the
  lowest-ranked ones outside the protected window (and sinks) are dropped, and a later, larger
  budget brings none back.

Two configurations share this machinery for claim C12: ``fixed`` (the same ranking, window and
permanent eviction at a fixed share ``budget``) and ``streaming`` (StreamingLLM's sinks plus the
most recent tokens at a share ``budget``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["MODES", "ConfKV", "budget_tokens", "confidence", "evict_order", "rank_scores"]

#: configuration kinds: the confidence-driven budget, its fixed-budget twin, the sliding window
MODES = ("confkv", "fixed", "streaming")


@dataclass(frozen=True)
class ConfKV:
    """One Conf-KV family configuration; every field validated.

    Attributes
    ----------
    mode : str
        ``confkv`` (budget from confidence), ``fixed`` (share ``budget``, same ranking and
        window) or ``streaming`` (``sinks`` first tokens and the most recent ones).
    budget_min, budget_max : float
        ``confkv``: the share kept at confidence 1 and at confidence 0, ``0 < min <= max <= 1``.
    budget : float or None
        ``fixed`` and ``streaming``: the share kept, in ``(0, 1]``; None for ``confkv``.
    window : int
        Protected recent window: the last ``window`` tokens of ``[0, t)`` are always kept.
    sinks : int
        The first ``sinks`` positions are always kept (0 for ``confkv``/``fixed``; Conf-KV names
        none).
    alpha : float
        Weight of the attention mass in the rank, ``[0, 1]``; ``1 - alpha`` is recency's.
    ema : float
        Decay of the accumulated attention mass per decode step, ``[0, 1)``.
    """

    mode: str = "confkv"
    budget_min: float = 0.1
    budget_max: float = 0.5
    budget: float | None = None
    window: int = 32
    sinks: int = 0
    alpha: float = 0.5
    ema: float = 0.9

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode = {self.mode!r}, expected one of {', '.join(MODES)}")
        for name in ("budget_min", "budget_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"{name} = {v!r}, expected a share in (0, 1]")
        if self.budget_min > self.budget_max:
            raise ValueError(f"budget_min = {self.budget_min} exceeds budget_max = "
                             f"{self.budget_max}")
        if self.mode == "confkv":
            if self.budget is not None:
                raise ValueError("budget: the confkv mode sets its budget from confidence; give "
                                 "budget_min/budget_max (budget is for fixed and streaming)")
        elif (self.budget is None or isinstance(self.budget, bool)
              or not isinstance(self.budget, (int, float)) or not 0 < self.budget <= 1):
            raise ValueError(f"budget = {self.budget!r}, expected a share in (0, 1] for mode "
                             f"{self.mode}")
        for name in ("window", "sinks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} = {v!r}, expected an int >= 0")
        if isinstance(self.alpha, bool) or not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha = {self.alpha!r}, expected a float in [0, 1]")
        if isinstance(self.ema, bool) or not 0 <= self.ema < 1:
            raise ValueError(f"ema = {self.ema!r}, expected a float in [0, 1)")

    @classmethod
    def streaming(cls, budget: float, window: int = 32, sinks: int = 4) -> ConfKV:
        """StreamingLLM at share ``budget``: ``sinks`` first tokens, then the most recent."""
        return cls(mode="streaming", budget=budget, window=window, sinks=sinks)

    @property
    def label(self) -> str:
        """The configuration id of its outcome rows."""
        if self.mode == "confkv":
            return (f"confkv[{self.budget_min:g}-{self.budget_max:g},w{self.window},"
                    f"a{self.alpha:g},e{self.ema:g}]")
        if self.mode == "fixed":
            return f"confkv_fixed[{self.budget:.4g},w{self.window},a{self.alpha:g},e{self.ema:g}]"
        return f"streaming[{self.budget:.4g},s{self.sinks}]"

    def share(self, conf: float) -> float:
        """The budget share of a step whose previous distribution has confidence ``conf``."""
        if self.mode != "confkv":
            return float(self.budget)
        return float(self.budget_max - conf * (self.budget_max - self.budget_min))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def confidence(logits: np.ndarray) -> float:
    """Scalar confidence in ``[0, 1]`` of a next-token distribution given by ``logits`` (V,).

    The mean of ``1 - H/log V`` (normalised entropy), ``p_1`` (top-1 mass) and ``1 - p_2/p_1``
    (top-1/top-2 margin), computed in float64.
    """
    z = np.asarray(logits, dtype=np.float64).ravel()
    if z.size < 2:
        raise ValueError(f"confidence: expected at least 2 logits, got {z.size}")
    z = z - z.max()
    p = np.exp(z)
    p /= p.sum()
    nz = p[p > 0]
    entropy = float(-(nz * np.log(nz)).sum())
    top2 = np.partition(p, -2)[-2:]
    p1, p2 = float(top2.max()), float(top2.min())
    value = ((1 - entropy / math.log(z.size)) + p1 + (1 - p2 / p1)) / 3
    return float(min(max(value, 0.0), 1.0))


def budget_tokens(share: float, n: int, protected: int) -> int:
    """Tokens kept out of the ``n`` a layer holds: ``round(share n)``, never fewer than the
    ``protected`` ones (window and sinks in the population), never more than ``n``."""
    return int(min(n, max(int(round(share * n)), min(protected, n))))


def rank_scores(mass: np.ndarray, lo: int, t: int, alpha: float) -> np.ndarray:
    """Conf-KV's rank of the tokens ``[lo, t)``: ``alpha A/max A + (1 - alpha) r`` per row.

    ``mass`` is ``(rows, t - lo)`` accumulated attention; ``r_i = (i - lo + 1)/(t - lo)``.
    """
    mass = np.asarray(mass, dtype=np.float64)
    n = t - lo
    top = mass.max(axis=-1, keepdims=True)
    norm = np.divide(mass, top, out=np.zeros_like(mass), where=top > 0)
    recency = np.arange(1, n + 1, dtype=np.float64) / max(n, 1)
    return alpha * norm + (1 - alpha) * recency


def evict_order(scores: np.ndarray, evictable: np.ndarray, n_evict: int) -> np.ndarray:
    """Indices of the ``n_evict`` lowest-scored evictable tokens of one row (ties: the older
    first), the tokens a step drops."""
    idx = np.flatnonzero(evictable)
    if n_evict <= 0 or idx.size == 0:
        return idx[:0]
    order = np.lexsort((idx, scores[idx]))
    return idx[order[:n_evict]]
