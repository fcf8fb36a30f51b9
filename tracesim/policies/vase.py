"""VaSE: a value-state guard plus stochastic selection over a chosen base score.

Source: Chang, Fu, Fu, Yang, Thomason, Jia, "Value-Aware Stochastic KV Cache Eviction for
Reasoning Models", arXiv 2606.03928 (2026). What was read: the abstract and secondary
summaries (a small share of value states has abnormally large magnitudes and must not be
evicted; stochastic eviction raises cache diversity). The method section (the exact share, the
magnitude norm, the sampling distribution, the VaSE-AttnV / VaSE-DKV variants) was not
reachable, so the rule below is the one issue #33 describes, not a verified port; see
docs/scores.md for every choice made here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score
from tracesim.policies.composed import base_score

__all__ = ["VaSEScore", "value_guard"]


def value_guard(values: np.ndarray, protected: np.ndarray, count: int) -> np.ndarray:
    """Mask of the ``count`` unprotected positions with the largest ‖v‖ (L2), ties: later.

    ``values`` (end, d) of one KV head; ``protected`` (end,) bool, already take-all.
    """
    guard = np.zeros(protected.size, dtype=bool)
    free = np.flatnonzero(~protected)
    count = min(int(count), free.size)
    if count <= 0:
        return guard
    norms = np.linalg.norm(np.asarray(values[free], dtype=np.float64), axis=1)
    # Stable sort of the reversed positions: among equal norms the later position wins.
    order = np.argsort(-norms[::-1], kind="stable")[:count]
    guard[free[::-1][order]] = True
    return guard


@dataclass(frozen=True)
class VaSEScore(Score):
    """Value guard (take-all) + Gumbel-perturbed base score (stochastic selection).

    Take-all: ``sinks``, ``window`` and the ``round(value_share * end)`` other positions of
    ``[0, end)`` with the largest value norm ‖v_i‖ of the KV head (the guard). Tail score:
    ``log x_i = log b_i + temperature * g_i`` with ``b`` the base score and Gumbel noise ``g_i``
    from permanent uniforms of stream 1 (per seed, layer, KV head, position). Under ``topk``
    the kept tail is then a sample without replacement with probabilities proportional to
    ``b_i^(1/temperature)`` (Gumbel-top-k): random, but with no closed-form inclusion
    probabilities, hence no certificate. ``temperature = 0`` gives the plain base score: use it
    with a ``poisson`` design for the certified version (capped PPS over ``b``, Hájek).

    Parameters
    ----------
    base : str, default "h2o"
        Registry name of the base score (built with this score's ``sinks`` and ``window``).
    value_share : float in [0, 1), default 0.05
        Share of the positions ``[0, end)`` kept take-all for their large ‖v‖.
    temperature : float >= 0, default 1
        Gumbel scale of the stochastic selection (0: deterministic base score).
    """

    name: ClassVar[str] = "vase"
    transform: ClassVar[str] = ("value guard take-all; base * exp(temperature * Gumbel) "
                                "(> 0), the base score as is at temperature 0")

    window: int = 32
    base: str = "h2o"
    value_share: float = 0.05
    temperature: float = 1.0

    @property  # type: ignore[override]
    def seed_dependent(self) -> bool:
        """Random only through its Gumbel noise (temperature > 0)."""
        return float(self.temperature) > 0.0

    def validate(self) -> None:
        if not 0.0 <= float(self.value_share) < 1.0:
            raise ValueError(f"VaSEScore.value_share = {self.value_share}: expected [0, 1)")
        if not float(self.temperature) >= 0.0:
            raise ValueError(f"VaSEScore.temperature = {self.temperature}: expected >= 0")
        self.base_score()

    def base_score(self) -> Score:
        """The base score (the registry's, with this score's sinks and window)."""
        return base_score("VaSEScore", self.base, int(self.sinks), int(self.window))

    def compress_end(self, trace: LayerTrace) -> int:
        return self.base_score().compress_end(trace)

    def guard_count(self, end: int) -> int:
        """Positions of ``[0, end)`` protected for their value norm."""
        return int(round(float(self.value_share) * end))

    def take_all(self, trace: LayerTrace, kv_head: int, end: int) -> np.ndarray:
        mask = super().take_all(trace, kv_head, end)
        return mask | value_guard(trace.values[kv_head, :end], mask, self.guard_count(end))

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        b = np.asarray(self.base_score().scores(trace, kv_head, end), dtype=np.float64)
        if float(self.temperature) == 0.0:
            return b
        u = trace.perturbation_uniforms(0 if seed is None else seed, kv_head, end)
        z = np.log(np.maximum(b, 1e-300)) + float(self.temperature) * -np.log(-np.log(u))
        # Relative to the maximum so exp() never overflows; the order is that of z.
        return np.exp(z - z.max())
