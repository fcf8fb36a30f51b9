"""``simhash:K,L``: angles estimated from SimHash codes of centred keys (MagicPIG's hash)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from scipy import special

from tracesim.prn import STREAM_HASH, permanent_uniforms
from tracesim.proxies.base import Proxy

if TYPE_CHECKING:  # the policies import the proxies, not the other way round
    from tracesim.layer_trace import LayerTrace

__all__ = ["MAX_HASH_BITS", "SimHashProxy", "hyperplanes"]

#: Largest K * L accepted: the codes cost K * L bits per token, and the (d, K L) hyperplanes
#: and (P, K L) codes are held in memory (4096 bits = 8x the fp16 keys of d = 64).
MAX_HASH_BITS = 4096
#: Bytes of the ``(queries, positions, K L / 8)`` XOR block made at a time when counting agreeing
#: bits (64 MiB: 119k positions at 3 queries and K L = 1500). The counts are exact integers
#: whatever the chunking, so the logits do not depend on it.
CODE_CHUNK_BYTES = 64 << 20


def hyperplanes(layer: int, kv_head: int, head_dim: int, n_bits: int, seed: int = 0) -> np.ndarray:
    """Gaussian hyperplanes ``(head_dim, n_bits)``, fixed per (seed, layer, KV head).

    Entry ``(c, j)`` is ``Phi^{-1}(u)`` of the permanent uniform of stream
    :data:`~tracesim.prn.STREAM_HASH` at position ``j * head_dim + c``: reproducible on any
    machine and in the torch path, and the same at every decode step (MagicPIG draws its hash
    once per generation).
    """
    u = permanent_uniforms(seed, layer, kv_head, np.arange(n_bits * head_dim), stream=STREAM_HASH)
    return special.ndtri(u).reshape(n_bits, head_dim).T


@dataclass(frozen=True)
class SimHashProxy(Proxy):
    """Logits ``|q| |k~| cos(theta_hat) * scale`` from ``K * L`` SimHash bits.

    Keys are centred by the mean of the KV head's prefill keys (MagicPIG centres by the mean of
    the keys it samples from; the shift changes every logit by the same ``q . mu``, so softmax
    is unchanged); each centred key keeps its ``K L`` sign bits against fixed Gaussian
    hyperplanes (:func:`hyperplanes`) and its norm. The angle to the query is estimated from the
    share ``a`` of agreeing bits as ``theta_hat = pi (1 - a)`` (SimHash: each bit agrees with
    probability ``1 - theta / pi``). The table structure (``K`` bits per table) matters for
    MagicPIG's collision rule, not for this estimate. Memory: ``K L`` bits plus a 16-bit norm
    per token.

    Parameters
    ----------
    bits : int, default 10
        ``K``, bits per table.
    tables : int, default 150
        ``L``, tables. ``K * L <= MAX_HASH_BITS``.
    """

    name: ClassVar[str] = "simhash"

    bits: int = 10
    tables: int = 150

    def validate(self) -> None:
        for field, v in (("bits", self.bits), ("tables", self.tables)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"simhash proxy: {field} = {v!r}: expected an int >= 1")
        if self.bits * self.tables > MAX_HASH_BITS:
            raise ValueError(f"simhash proxy: K * L = {self.bits} * {self.tables} = "
                             f"{self.bits * self.tables} bits per token: expected <= "
                             f"{MAX_HASH_BITS}")

    def spec(self) -> str:
        return f"simhash:{self.bits},{self.tables}"

    def bits_per_token(self, head_dim: int) -> float:
        return float(self.bits * self.tables + 16)

    def _codes(self, trace: LayerTrace, kv_head: int):
        K = trace.keys[kv_head]
        mu = K[:trace.prompt_length].mean(axis=0)
        W = hyperplanes(trace.layer, kv_head, K.shape[1], self.bits * self.tables)
        Kc = K - mu
        return mu, W, _packed_signs(Kc @ W), np.linalg.norm(Kc, axis=1)

    def extend(self, previous, trace: LayerTrace, kv_head: int):
        """The codes of an earlier step of the layer plus one code per appended token.

        A token's code and norm read only its own key, the hyperplanes and the prompt's mean
        key, so the codes of positions the previous step held are kept as they are (MagicPIG
        hashes each key once, when it enters the cache). Rebuilt (None) when the prompt's mean
        differs, i.e. ``previous`` is not of this layer's cache.
        """
        mu, W, codes, norms = previous
        K = trace.keys[kv_head]
        n = codes.shape[0]
        if (n > K.shape[0] or W.shape != (K.shape[1], self.bits * self.tables)
                or not np.array_equal(K[:trace.prompt_length].mean(axis=0), mu)):
            return None
        Kc = K[n:] - mu
        return (mu, W, np.concatenate([codes, _packed_signs(Kc @ W)]),
                np.concatenate([norms, np.linalg.norm(Kc, axis=1)]))

    def logits(self, trace: LayerTrace, kv_head: int, queries: np.ndarray,
               end: int) -> np.ndarray:
        mu, W, codes, norms = self._cached(trace, kv_head, lambda: self._codes(trace, kv_head))
        q = np.asarray(queries, dtype=np.float64)
        qcode = _packed_signs(q @ W)  # (n, nb / 8)
        nb = W.shape[1]
        # Disagreeing bits = popcount(q XOR code) over the packed codes (the zero padding of
        # the last byte agrees); integers, so chunking the positions changes no bit.
        agree = np.empty((qcode.shape[0], end))
        step = max(1, CODE_CHUNK_BYTES // max(1, qcode.shape[0] * qcode.shape[1]))
        for a in range(0, end, step):
            b = min(end, a + step)
            differ = np.bitwise_count(qcode[:, None, :] ^ codes[None, a:b, :]).sum(
                axis=2, dtype=np.int64)
            agree[:, a:b] = nb - differ
        theta = np.pi * (1.0 - agree / nb)
        qn = np.linalg.norm(q, axis=1)[:, None]
        return (qn * norms[None, :end] * np.cos(theta) + (q @ mu)[:, None]) * trace.scale


def _packed_signs(x: np.ndarray) -> np.ndarray:
    """Sign bits ``x > 0`` of each row, packed 8 to a byte (``(rows, ceil(cols / 8))`` uint8):
    a token's code costs ``K L / 8`` bytes in memory, as it would on a server."""
    return np.packbits(x > 0, axis=1)
