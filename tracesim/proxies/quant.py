"""``quant:b``: keys quantised to ``b`` bits per channel over groups of tokens (KIVI-style)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from tracesim.kernels.quantise import quantise_groups
from tracesim.proxies.base import Proxy

if TYPE_CHECKING:  # the policies import the proxies, not the other way round
    from tracesim.layer_trace import LayerTrace

__all__ = ["QuantProxy", "quantise_keys"]

BITS = (1, 2, 4, 8)
#: Most bytes of proxy logits :meth:`QuantProxy.step_logits` computes ahead for one KV head.
STEP_LOGIT_BYTES = 8 << 20


def quantise_keys(keys: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Round-trip ``keys`` (P, d) through asymmetric ``bits``-bit quantisation per channel.

    Tokens are cut into groups of ``group`` consecutive positions from position 0 (the last
    group may be shorter); within a group each channel has its own zero point (the minimum) and
    step ``(max - min) / (2**bits - 1)``, and each entry is rounded to the nearest level
    (KIVI's key quantisation: per channel, grouped along tokens). A constant channel is exact.
    Returns the dequantised keys, float64, same shape.
    """
    K = np.ascontiguousarray(keys, dtype=np.float64)
    out = np.empty_like(K)
    if K.size:
        # compiled, entry by entry in the order of numpy's lo + rint((k - lo) / step) * step
        quantise_groups(K, (1 << bits) - 1, int(group), out)
    return out


@dataclass(frozen=True)
class QuantProxy(Proxy):
    """Logits from keys quantised to ``bits`` bits (per channel, groups of ``group`` tokens).

    Parameters
    ----------
    bits : {1, 2, 4, 8}
    group : int, default 32
        Tokens per quantisation group (each group stores a zero point and a step per channel
        in fp16: ``32 / group`` bits per channel per token on top of ``bits``). At the step of
        position ``t`` only the groups complete before ``t`` are quantised; the fewer than
        ``group`` tokens after them are read in full precision (KIVI's residual; not counted
        in :meth:`bits_per_token`).
    """

    name: ClassVar[str] = "quant"

    bits: int = 4
    group: int = 32

    def validate(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in BITS:
            raise ValueError(f"quant proxy: bits = {self.bits!r}: expected one of {BITS}")
        if isinstance(self.group, bool) or not isinstance(self.group, int) \
                or not 1 <= self.group <= 1 << 16:
            raise ValueError(f"quant proxy: group = {self.group!r}: expected an int in "
                             "[1, 65536] (tokens per quantisation group)")

    def spec(self) -> str:
        return f"quant:{self.bits}" + (f",{self.group}" if self.group != 32 else "")

    def bits_per_token(self, head_dim: int) -> float:
        return head_dim * (self.bits + 32.0 / self.group)

    def logits(self, trace: LayerTrace, kv_head: int, queries: np.ndarray,
               end: int) -> np.ndarray:
        Kq = self._cached(trace, kv_head, lambda: quantise_keys(trace.keys[kv_head], self.bits,
                                                                 self.group))
        # Only groups complete before the step are quantised (their zero point and step read
        # no later key); the partial group at the end stays in full precision, as KIVI keeps
        # its residual tokens (with window >= group these are all in the take-all window).
        full = (end // self.group) * self.group
        return (queries @ self._step_keys(trace, kv_head, Kq, full)[:end].T) * trace.scale

    def step_logits(self, trace: LayerTrace, kv_head: int, heads: list[int], query_index: int,
                    end: int) -> np.ndarray:
        """The steps ``end .. full + group - 1`` read the same keys (``full`` = the complete
        groups before ``end``), so their stored queries' logits are one product: read from the
        keys once, not once per step (a per-step product of a few query rows with every key is
        bound by reading the keys). At most :data:`STEP_LOGIT_BYTES` are computed ahead."""
        full = (end // self.group) * self.group
        key = ("proxy-step-logits", self.spec(), int(kv_head), tuple(heads))
        cache = trace._attention_cache
        held = cache.get(key)
        if held is None or held[0] != full or query_index not in held[1]:
            pos = trace.query_positions
            ahead = np.flatnonzero((pos >= end) & (pos < full + self.group))
            ahead = ahead[np.argsort(pos[ahead], kind="stable")]
            n_ahead = max(1, STEP_LOGIT_BYTES // (8 * len(heads) * trace.n_positions))
            ahead = ahead[:n_ahead]
            if query_index not in ahead:
                return super().step_logits(trace, kv_head, heads, query_index, end)
            Kq = self._cached(trace, kv_head, lambda: quantise_keys(
                trace.keys[kv_head], self.bits, self.group))
            keys = self._step_keys(trace, kv_head, Kq, full)
            q = trace.queries[np.ix_(heads, ahead)].reshape(-1, keys.shape[1])
            block = ((q @ keys.T) * trace.scale).reshape(len(heads), ahead.size, -1)
            held = (full, {int(i): j for j, i in enumerate(ahead)}, block)
            cache[key] = held
        return held[2][:, held[1][query_index], :end]

    def _step_keys(self, trace: LayerTrace, kv_head: int, Kq: np.ndarray,
                   full: int) -> np.ndarray:
        """``[Kq[:full], keys[full:]]``, shape (P, d): the keys every step with the same
        ``full`` reads (its first ``end`` rows). Built once per complete group rather than
        concatenated at every step, and replaced, never written, when ``full`` moves on."""
        key = ("proxy-step-keys", self.spec(), int(kv_head))
        cache = trace._attention_cache
        held = cache.get(key)
        if held is None or held[0] != full:
            held = (full, np.concatenate([Kq[:full], trace.keys[kv_head, full:]]))
            cache[key] = held
        return held[1]
