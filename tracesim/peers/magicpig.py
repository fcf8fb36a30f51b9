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

Attention variants (``docs/peers.md``, "Attention variants"): on a sliding layer of window
``w`` the prefill's cache holds ``[max(0, P - w), P)``, and the sampled range and its centring
mean are taken within it (its first ``sinks`` positions dense); at step ``t`` the layer holds
``(t - w, t]``, whose first ``sinks`` positions are dense, and only the hashed keys still in it
can be used. The hash and ``u`` read raw ``q . k`` angles, as in the reference; soft-capped
logits and a sink (a take-all denominator term with value zero) enter the softmax only.

The used set is not a Poisson sample: one shared hash decides every key, so inclusions are
correlated across keys and steps. tracesim's certificate is computed as if they were Poisson
with ``pi = min(1, u + 1e-4)`` (the weights MagicPIG divides by); how far that is off is
measured, not assumed.

**Replicates** (``replicates = R >= 2``, not in the reference): ``R`` independent hash sets,
the estimate of each computed as above, their mean reported; the spread of the ``R`` estimates
gives a variance that accounts for the shared hash (:func:`replicate_hyperplanes` for the keys of
the draws, :meth:`MagicPIG.attend` for the columns).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from scipy import special

from tracesim.estimators import hajek_attention
from tracesim.peers.base import Peer, StepInput, hajek_step_metrics
from tracesim.proxies.simhash import MAX_HASH_BITS, hyperplanes

__all__ = ["MAX_REPLICATES", "MagicPIG", "collision_probability", "replicate_hyperplanes"]

#: Largest number of independent hash sets per (seed, layer, KV head): each costs ``K L`` bits
#: per token of codes and one attention over its used keys, so the cost grows linearly.
MAX_REPLICATES = 64


def replicate_hyperplanes(layer: int, kv_head: int, head_dim: int, n_bits: int, seed: int,
                          replicate: int) -> np.ndarray:
    """Hyperplanes ``(head_dim, n_bits)`` of hash set ``replicate`` of one (seed, layer, KV head).

    Entry ``(c, j)`` is ``Phi^{-1}(u)`` of the permanent uniform with key ``(seed, stream 2,
    layer, kv_head field replicate * 2**16 + kv_head, position j * head_dim + c)``: replicate 0
    is :func:`~tracesim.proxies.simhash.hyperplanes` itself (the single hash of ``replicates =
    1``), and every (seed, replicate) pair has its own key, so the hash sets of all seeds and
    replicates are independent draws.
    """
    if not 0 <= kv_head < 1 << 16:
        raise ValueError(f"KV head {kv_head} outside [0, 65536)")
    if not 0 <= replicate < 1 << 16:
        raise ValueError(f"replicate {replicate} outside [0, 65536)")
    return hyperplanes(layer, (int(replicate) << 16) + int(kv_head), head_dim, n_bits, seed=seed)


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
    replicates : int
        ``R``, independent hash sets (1, the reference; at most :data:`MAX_REPLICATES`). With
        ``R >= 2`` the output is the mean of the ``R`` MagicPIG estimates, with the replicate
        variance next to the Poisson-style one (:meth:`attend`).
    """

    name: ClassVar[str] = "magicpig"

    bits: int = 10
    tables: int = 150
    sinks: int = 4
    local: int = 64
    min_collisions: int = 2
    replicates: int = 1

    def __post_init__(self) -> None:
        self._check_ints(1, "bits", "tables", "min_collisions", "replicates")
        if self.replicates > MAX_REPLICATES:
            raise ValueError(f"magicpig: replicates = {self.replicates}: expected <= "
                             f"{MAX_REPLICATES}")
        self._check_ints(0, "sinks", "local")
        if self.bits * self.tables > MAX_HASH_BITS:
            raise ValueError(f"magicpig: K * L = {self.bits * self.tables}: expected <= "
                             f"{MAX_HASH_BITS}")

    def label(self) -> str:
        extra = f",replicates={self.replicates}" if self.replicates != 1 else ""
        return (f"magicpig(K={self.bits},L={self.tables},sinks={self.sinks},"
                f"local={self.local},collisions={self.min_collisions}{extra})")

    def prepare(self, layer, kv_head, keys, prompt_length, seed, window=None):
        """Centring mean, and per replicate the hyperplanes and the codes of the sampled
        range: ``(lo, hi, mu, ((W, codes), ...), centred key norms)``, positions ``[lo, hi)``.

        On a sliding layer the prefill's cache holds ``[max(0, P - w), P)``: the range is
        hashed and centred within it (``docs/peers.md``, "Attention variants")."""
        held = 0 if window is None else max(0, prompt_length - int(window))
        lo = held + self.sinks
        hi = max(lo, prompt_length - self.local)
        mu = keys[lo:hi].mean(axis=0) if hi > lo else np.zeros(keys.shape[1])
        kc = keys[lo:hi] - mu
        hashes = []
        for r in range(self.replicates):
            W = replicate_hyperplanes(layer, kv_head, keys.shape[1], self.bits * self.tables,
                                      seed, r)
            hashes.append((W, self._codes(kc @ W)))
        return lo, hi, mu, tuple(hashes), np.linalg.norm(kc, axis=1)

    def _codes(self, proj: np.ndarray) -> np.ndarray:
        """Sign bits (n, L, K) from projections (n, K L), table-major columns. The bits are
        compared table by table, not packed into an integer (which overflows past 63 bits)."""
        return (proj > 0).reshape(proj.shape[0], self.tables, self.bits)

    def attend(self, x: StepInput, state, seed: int, z: float):
        """One step: the row, the output and the attended tokens (:meth:`Peer.attend`).

        With ``replicates = 1`` the row is MagicPIG's estimate with the Poisson-style
        certificate (``cert2``, ``wald_cov``); ``kept_tokens`` = ``rows_read`` = the attended
        tokens. With ``R >= 2`` see :meth:`_replicate_row`.
        """
        lo0, hi0, mu, hashes, knorm = state
        n = x.n
        # what the layer holds now: the hashed range less the window's first `sinks` positions
        # (dense) and what slid out of the window; indices below are relative to x.start
        cut = max(0, x.start + self.sinks - lo0)
        lo, hi = max(0, lo0 + cut - x.start), max(0, hi0 - x.start)
        hi = max(lo, hi)
        used_sets = []
        for W, codes in hashes:
            qcode = self._codes((x.query @ W)[None])[0]
            matches = (codes[cut:cut + hi - lo] == qcode[None]).all(axis=2).sum(axis=1)
            used_sets.append(matches >= self.min_collisions)
        kc = x.keys[lo:hi] - mu
        cos = (kc @ x.query) / np.maximum(knorm[cut:cut + hi - lo] * np.linalg.norm(x.query),
                                          1e-300)
        u = collision_probability(cos, self.bits, self.tables, self.min_collisions)
        pi = np.ones(n)
        pi[lo:hi] = np.minimum(1.0, u + 1e-4)  # the weights the reference divides by
        if self.replicates > 1:
            return self._replicate_row(x, pi, used_sets, lo, hi, float(u.sum()), z)
        used = used_sets[0]
        kept = np.ones(n, dtype=bool)
        kept[lo:hi] = used
        row = hajek_step_metrics(x, pi, kept, z)
        row.update(kept_tokens=int(kept.sum()), sampled=int(used.sum()),
                   expected_sampled=float(u.sum()), peer_bound_ok=float("nan"),
                   replicates=1, rows_read=int(kept.sum()))
        return row, row["estimate"], kept

    def _replicate_row(self, x: StepInput, pi: np.ndarray, used_sets: list[np.ndarray],
                       lo: int, hi: int, expected_sampled: float, z: float):
        """The row of ``R >= 2`` independent hash sets.

        Each replicate ``r`` gives MagicPIG's estimate ``o_r`` (shape (d,)) and the diagonal
        ``V_r`` of its Poisson-style variance. The output is ``o_bar = mean_r o_r``.

        - ``rep_cert2`` = ``sum_c s_c^2 / R`` (value units squared, like ``cert2``), ``s_c^2``
          the Bessel-corrected variance of coordinate ``c`` over the replicates;
          ``rep_cov`` is the share of coordinates with ``|o_bar - o| <= t sqrt(s_c^2 / R)``,
          ``t`` the ``t_{R-1}`` quantile at the level of ``z``.
        - ``cert2`` = ``sum_c sum_r V_r,c / R^2``, the Poisson-style variance of the mean
          (the replicates are independent, the keys within one are treated as Poisson);
          ``wald_cov`` its ``z`` interval on the same ``o_bar``.
        - Cost: ``rows_read`` = ``sum_r`` the tokens replicate ``r`` attends (each replicate is
          one attention); ``kept_tokens`` and ``sampled`` count *distinct* tokens of the union
          over replicates (rows a fetch brings once); ``expected_sampled`` is one hash draw's.
        - ``tail_size``, ``n_eff``: means over replicates.
        """
        R = len(used_sets)
        n = x.n
        estimates, variances, tails, n_effs, rows_read = [], [], [], [], 0
        any_tail = False
        union = np.zeros(hi - lo, dtype=bool)
        for used in used_sets:
            kept = np.ones(n, dtype=bool)
            kept[lo:hi] = used
            est = hajek_attention(x.query, x.keys, x.values, pi, kept, scale=x.scale,
                                  correction=True, variance="diag", softcap=x.softcap,
                                  sink=x.sink)
            estimates.append(est.estimate)
            variances.append(est.variance_diag)
            tails.append(float(est.tail_size))
            n_effs.append(float(est.n_eff))
            any_tail = any_tail or bool(est.tail_population)
            rows_read += int(kept.sum())
            union |= used
        stacked = np.stack(estimates)  # (R, d)
        mean = stacked.mean(axis=0)
        err = mean - x.truth
        rep_var = stacked.var(axis=0, ddof=1) / R
        poisson_var = np.maximum(np.sum(variances, axis=0), 0.0) / R**2
        t = float(special.stdtrit(R - 1, special.ndtr(z)))
        nan = float("nan")
        kept = np.ones(n, dtype=bool)
        kept[lo:hi] = union
        row = {"err2": float(err @ err), "estimate": mean, "tail_size": float(np.mean(tails)),
               "n_eff": float(np.mean(n_effs)), "cert2": float(poisson_var.sum()),
               "wald_cov": (float(np.mean(np.abs(err) <= z * np.sqrt(poisson_var)))
                            if any_tail else nan),
               "rep_cert2": float(rep_var.sum()),
               "rep_cov": (float(np.mean(np.abs(err) <= t * np.sqrt(rep_var)))
                           if any_tail else nan),
               "kept_tokens": int(kept.sum()), "sampled": int(union.sum()),
               "expected_sampled": expected_sampled, "peer_bound_ok": nan,
               "replicates": R, "rows_read": rows_read}
        return row, mean, kept
