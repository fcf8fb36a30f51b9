"""MagicPIG (arXiv 2410.16179), replayed as its reference code defines it.

Read from ``Infini-AI-Lab/MagicPIG`` (``evaluations/RULER/pred/cache_ref.py``, the single-GPU
reference, and ``attnserver_dist.py``):

- **Dense part**, attended exactly: the first ``sinks`` = 4 tokens, the last ``local`` = 64
  tokens *of the prefill*, and every generated token including the current one. Only prefill
  positions ``[4, P - 64)`` are hashed and sampled (``P`` the prompt length).
- **Centring**: the keys are centred by the mean key of the sampled range (per layer and KV
  head, once at prefill); the query is not centred.
- **Hash**: Gaussian hyperplanes, ``K`` bits x ``L`` tables, one set per (layer, KV head) and
  seed (``cache_ref.py`` draws one per KV head), fixed for the whole generation: the seed is the
  hash draw. A table's code is the sign pattern of its ``K`` projections.
- **Collision rule**: a sampled-range key is used by query head ``h`` when its code equals the
  query's in at least ``min_collisions`` = 2 of the ``L`` tables.
- **Weight**: ``u = 1 - (1 - p^K)^L - L p^K (1 - p^K)^(L - 1)``, ``p = 1 - theta / pi`` with
  ``theta`` the angle between the raw query and the centred key (the cosine clamped to
  [-1, 1]; the reference does not clamp, bf16 rounding can give NaN there); the used key's logit
  gets ``- log(u + 1e-4)``; one softmax over the dense part and the used keys.

Differences: the hyperplanes come from tracesim's permanent uniforms (stream 2, inverse normal
CDF) instead of ``torch.randn``; float64 throughout; every layer is sparse (the reference keeps
layers 0, 16, 32, 48 dense; replay those layers only if you want its exact set).

The used set is not a Poisson sample: one shared hash decides every key, so inclusions are
correlated across keys and steps. tracesim's certificate is computed as if they were Poisson
with ``pi = min(1, u + 1e-4)`` (the weights MagicPIG divides by); how far that is off is
measured, not assumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.peers.base import Peer, StepInput, hajek_row
from tracesim.proxies.simhash import MAX_HASH_BITS, hyperplanes

__all__ = ["MagicPIG", "collision_probability"]


def collision_probability(cos: np.ndarray, bits: int, tables: int,
                          min_collisions: int = 2) -> np.ndarray:
    """Probability over the hash draw that a key collides with the query in at least
    ``min_collisions`` of ``tables`` tables of ``bits`` bits, given their cosine.

    Each table collides with probability ``p^K``, ``p = 1 - arccos(cos) / pi``; tables are
    independent, so the count is binomial (``min_collisions = 2`` gives MagicPIG's formula).
    """
    p = 1.0 - np.arccos(np.clip(cos, -1.0, 1.0)) / np.pi
    c = p**bits
    out = np.ones_like(c)
    for j in range(min_collisions):  # 1 - P(count < min_collisions)
        from math import comb

        out -= comb(tables, j) * c**j * (1.0 - c) ** (tables - j)
    return np.clip(out, 0.0, 1.0)


@dataclass(frozen=True)
class MagicPIG(Peer):
    """MagicPIG's LSH sampling; see the module docstring for the rule and its source.

    Parameters
    ----------
    bits, tables : int
        ``K`` and ``L`` (reference defaults 10 and 150).
    sinks, local : int
        Dense prefix and dense tail of the prefill (4 and 64).
    min_collisions : int
        Tables in which the codes must match (2).
    """

    name: ClassVar[str] = "magicpig"

    bits: int = 10
    tables: int = 150
    sinks: int = 4
    local: int = 64
    min_collisions: int = 2

    def __post_init__(self) -> None:
        self._check_ints(1, "bits", "tables", "min_collisions")
        self._check_ints(0, "sinks", "local")
        if self.bits * self.tables > MAX_HASH_BITS:
            raise ValueError(f"magicpig: K * L = {self.bits * self.tables}: expected <= "
                             f"{MAX_HASH_BITS}")

    def label(self) -> str:
        return (f"magicpig(K={self.bits},L={self.tables},sinks={self.sinks},"
                f"local={self.local},collisions={self.min_collisions})")

    def prepare(self, layer, kv_head, keys, prompt_length, seed):
        lo, hi = self.sinks, max(self.sinks, prompt_length - self.local)
        mu = keys[lo:hi].mean(axis=0) if hi > lo else np.zeros(keys.shape[1])
        W = hyperplanes(layer, kv_head, keys.shape[1], self.bits * self.tables, seed=seed)
        kc = keys[lo:hi] - mu
        codes = self._codes(kc @ W)
        return lo, hi, mu, W, codes, np.linalg.norm(kc, axis=1)

    def _codes(self, proj: np.ndarray) -> np.ndarray:
        """Sign bits (n, L, K) from projections (n, K L), table-major columns. The bits are
        compared table by table, not packed into an integer (which overflows past 63 bits)."""
        return (proj > 0).reshape(proj.shape[0], self.tables, self.bits)

    def attend(self, x: StepInput, state, seed: int, z: float):
        lo, hi, mu, W, codes, knorm = state
        n = x.step + 1
        qcode = self._codes((x.query @ W)[None])[0]
        matches = (codes == qcode[None]).all(axis=2).sum(axis=1)
        used = matches >= self.min_collisions
        kc = x.keys[lo:hi] - mu
        cos = (kc @ x.query) / np.maximum(knorm * np.linalg.norm(x.query), 1e-300)
        u = collision_probability(cos, self.bits, self.tables, self.min_collisions)
        pi = np.ones(n)
        kept = np.ones(n, dtype=bool)
        pi[lo:hi] = np.minimum(1.0, u + 1e-4)  # the weights the reference divides by
        kept[lo:hi] = used
        row = hajek_row(x, pi, kept, z)
        row.update(kept_tokens=int(kept.sum()), sampled=int(used.sum()),
                   expected_sampled=float(u.sum()), peer_bound_ok=float("nan"))
        return row, row["estimate"], kept
