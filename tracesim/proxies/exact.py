"""``exact``: the full logits themselves (a reference, not deployable)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from tracesim.proxies.base import Proxy

if TYPE_CHECKING:  # the policies import the proxies, not the other way round
    from tracesim.layer_trace import LayerTrace

__all__ = ["ExactProxy"]


@dataclass(frozen=True)
class ExactProxy(Proxy):
    """``s_i = q . k_i * scale`` from the full keys: the step's own attention.

    It generalises the ``oracle`` score (the decode queries' *averaged* attention, fixed at
    prefill) to each step's own query. Reading every full key at every step is what a per-step
    design exists to avoid, so it is not deployable; it bounds what any proxy can give. Memory
    is counted as the full keys at 16 bits per entry.
    """

    name: ClassVar[str] = "exact"
    deployable: ClassVar[bool] = False

    def spec(self) -> str:
        return "exact"

    def bits_per_token(self, head_dim: int) -> float:
        return 16.0 * head_dim

    def logits(self, trace: LayerTrace, kv_head: int, queries: np.ndarray,
               end: int) -> np.ndarray:
        return (queries @ trace.keys[kv_head, :end].T) * trace.scale
