"""Keyformer-like: Gumbel-perturbed accumulated attention (random, pi unknown)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score
from tracesim.policies.h2o import accumulated_attention

__all__ = ["KeyformerScore"]


@dataclass(frozen=True)
class KeyformerScore(Score):
    """``log x_i = log(h2o_i) + tau * g_i`` with Gumbel noise ``g_i = -log(-log u_i)``.

    ``u_i`` are permanent uniforms of stream 1 (perturbations), so the noise is reproducible
    per (seed, layer, kv head, position). With the ``topk`` design this is Gumbel-top-k: random,
    but the inclusion probabilities have no closed form, so the estimate is left uncorrected and
    no certificate is reported (``default_correction = "none"``). With a Poisson design the
    probabilities are known *given the noise*, and Hájek applies conditionally.

    Parameters
    ----------
    temperature : float, default 1
        ``tau``: Gumbel scale (0 gives plain H2O).
    normalize : bool, default False
        As for :class:`~tracesim.policies.h2o.H2OScore`.
    """

    name: ClassVar[str] = "keyformer"
    seed_dependent: ClassVar[bool] = True
    default_correction: ClassVar[str] = "none"
    transform: ClassVar[str] = "h2o * exp(tau * Gumbel) (> 0)"

    window: int = 32
    temperature: float = 1.0
    normalize: bool = False

    def validate(self) -> None:
        if not float(self.temperature) >= 0.0:
            raise ValueError(f"KeyformerScore.temperature = {self.temperature}: expected >= 0")

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        base = accumulated_attention(trace, kv_head, end, self.normalize)
        u = trace.perturbation_uniforms(0 if seed is None else seed, kv_head, end)
        gumbel = -np.log(-np.log(u))
        # Work in logs relative to the maximum so exp() never overflows.
        z = np.log(np.maximum(base, 1e-300)) + float(self.temperature) * gumbel
        return np.exp(z - z.max())
