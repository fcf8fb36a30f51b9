"""CurDKV (kvpress ``CURPress``): local leverage-like scores of keys and values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score

__all__ = ["CURScore", "local_normalize"]

LEVERAGE_TYPES = ("key", "value", "kv_avg", "kv_product")


def local_normalize(x: np.ndarray, w: int) -> np.ndarray:
    """Divide ``x`` (1-D, >= 0) by its sum over consecutive blocks of ``w`` (last block short)."""
    n = x.size
    pad = np.concatenate([x, np.zeros((-n) % w)]).reshape(-1, w)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = pad / pad.sum(axis=1, keepdims=True)
    return np.nan_to_num(out.reshape(-1)[:n])


@dataclass(frozen=True)
class CURScore(Score):
    """Squared norms ``‖k_i‖²`` and ``‖v_i‖²``, normalized per block, combined, normalized.

    With ``local_window`` > 0 each of ``‖k‖²`` and ``‖v‖²`` is divided by its sum over blocks of
    ``local_window`` consecutive positions (from position 0); then ``leverage`` picks ``key``,
    ``value``, ``kv_avg`` (mean) or ``kv_product`` (product, the default), and the result is
    divided by its sum over ``[0, end)``. kvpress sets the first ``num_sinks`` scores to 1; here
    the ``sinks`` take-all stratum keeps them. kvpress's optional random projection
    (``use_random_leverage``) is not ported.

    Reads only the post-RoPE keys and the values of positions ``[0, end)`` (no query).
    """

    name: ClassVar[str] = "cur"
    transform: ClassVar[str] = "normalized local leverage (>= 0 as is)"

    window: int = 0
    leverage: str = "kv_product"
    local_window: int = 16

    def validate(self) -> None:
        if self.leverage not in LEVERAGE_TYPES:
            raise ValueError(f"CURScore.leverage = {self.leverage!r}: expected one of "
                             f"{LEVERAGE_TYPES}")
        if isinstance(self.local_window, bool) or self.local_window < 0:
            raise ValueError(f"CURScore.local_window = {self.local_window}: expected an int "
                             ">= 0 (0: no local normalization)")

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        k2 = (trace.keys[kv_head, :end] ** 2).sum(axis=1)
        v2 = (trace.values[kv_head, :end] ** 2).sum(axis=1)
        if self.local_window > 0:
            k2, v2 = local_normalize(k2, self.local_window), local_normalize(v2, self.local_window)
        x = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[
            self.leverage]
        total = x.sum()
        return x / total if total > 0 else np.ones(end)
