"""``lowrank:r``: keys projected on a rank-``r`` basis of the prefill keys (Loki-style)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from tracesim.proxies.base import Proxy

if TYPE_CHECKING:  # the policies import the proxies, not the other way round
    from tracesim.layer_trace import LayerTrace

__all__ = ["LowRankProxy"]


@dataclass(frozen=True)
class LowRankProxy(Proxy):
    """Logits ``(q B)(k B)^T * scale`` with ``B`` the top ``rank`` right singular vectors of the
    layer's prefill keys (positions ``< prompt_length``) of the KV head, uncentred: the rank-r
    subspace that best reconstructs the keys, so ``q . k`` is approximated by ``q . B B^T k``.

    Loki computes its basis offline from pre-RoPE keys of calibration data; the store holds
    post-RoPE keys, whose rotation spreads energy across channels, so this proxy is weaker than
    Loki's (documented in ``docs/perstep.md``). Memory: ``rank`` fp16 coefficients per token
    (the ``d x rank`` basis per head is not counted per token).

    Parameters
    ----------
    rank : int
        ``1 <= rank <= head_dim``.
    """

    name: ClassVar[str] = "lowrank"

    rank: int = 16

    def validate(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lowrank proxy: rank = {self.rank!r}: expected an int >= 1")

    def check_head_dim(self, head_dim: int) -> None:
        d = head_dim
        if self.rank > d:
            raise ValueError(f"lowrank proxy: rank = {self.rank} > head_dim = {d}: expected "
                             f"1 <= rank <= {d}")

    def spec(self) -> str:
        return f"lowrank:{self.rank}"

    def bits_per_token(self, head_dim: int) -> float:
        return 16.0 * self.rank

    def _projected(self, trace: LayerTrace, kv_head: int) -> np.ndarray:
        K = trace.keys[kv_head]
        _, _, vt = np.linalg.svd(K[:trace.prompt_length], full_matrices=False)
        basis = vt[:self.rank].T  # (d, r)
        return K @ basis @ basis.T

    def logits(self, trace: LayerTrace, kv_head: int, queries: np.ndarray,
               end: int) -> np.ndarray:
        self.check_trace(trace)
        Kp = self._cached(trace, kv_head, lambda: self._projected(trace, kv_head))
        return (queries @ Kp[:end].T) * trace.scale
