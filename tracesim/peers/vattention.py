"""vAttention (arXiv 2510.05688), replayed as ``xAlg-ai/sparse-attention-hub`` defines it.

Read from the hub's ``AdaptiveSamplingMasker`` (``adaptive_sampling.py``), its fixed sink,
local and oracle top-k maskers and ``mask_attention_utils.py`` (branch ``main``). For one query
head at one decode step over ``N = t + 1`` keys (the current one included):

1. **Deterministic part** (weight 1): the first ``sinks`` positions, the last ``local``
   positions (the current token included), and the ``heavy`` positions of largest exact
   ``q . k`` among the rest (oracle top-k). ``heavy`` is read as the hub's maskers read a size:
   a float is a fraction, ``int(heavy N)`` positions (so ``1.0`` is all N), an int a count.
   Each masker switches to full attention on its own rule: ``N <= sinks``, ``N <= local + 1``
   (one query), ``N <= heavy`` tokens.
2. **Range** ``[sinks, N - local)``, ``R`` positions; it does not exclude the top-k positions.
   ``R < 2``: full attention.
3. **Base sample**: ``n_base = max(2, int(base_rate R))`` uniform draws with replacement; ``e_j =
   exp(s_j - max s)``; ``sigma`` is the (Bessel-corrected) standard deviation of the drawn
   ``e`` (duplicates included, at least 1e-8); ``D_hat`` = sum of ``e`` over the deterministic
   part + ``R / n_base`` x sum of ``e`` over the *distinct* base draws.
4. **Budget**: ``b = floor(clip((z sigma R / max(epsilon D_hat, 1e-8))^2, 1, R))`` with ``z =
   Phi^-1(1 - delta)`` (one-sided: delta is not halved), then ``clip(b, n_base, R)``; per head.
5. **Final sample**: ``b`` new uniform draws with replacement over the range (the base draws are
   discarded); each distinct drawn position not in the deterministic part gets weight ``R / b``;
   the estimate is ``sum w e v / sum w e`` over the selected positions.

**Attention variants** (``docs/peers.md``, "Attention variants"). On a sliding layer the ``N``
keys are the window ``(t - w, t]`` the layer holds, so the sinks are the window's oldest
``sinks`` positions and every size is a share of the window. Soft-capped logits replace ``s``
everywhere (the top-k, ``e``, the estimate). A learned sink is a take-all term of the
denominator with value zero: ``e_sink = exp(sink - top)`` (``top`` the largest of the logits and
the sink) is added to ``D``, ``D_hat`` and ``D_b`` and to the estimate's denominator, and is not
a key: it is not in the range, the draws or ``sigma``.

The guarantee whose violation rate is measured: ``|o_hat - o| <= epsilon |o|`` at the nominal
``delta``, and the denominator statement the code's rule targets, ``|D_b - D| <= epsilon D``.

Differences: uniform draws from tracesim's permanent uniforms (per seed, layer, query head,
step; ``floor(u R)``) instead of ``torch.randint``; float64 (the hub casts ``b / R`` to the
query dtype, bf16 in its runs, and adds 1e-6 to weights and masks: not reproduced). The top-k
is the oracle's (the hub's HashAttention top-k needs trained weights).

tracesim's certificate on the same kept set: the Hájek estimate with the exact inclusion
probability of a position under ``b`` draws with replacement, ``1 - (1 - 1/R)^b``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from scipy import special

from tracesim.peers.base import (
    PURPOSE_VATT_BASE,
    PURPOSE_VATT_FINAL,
    Peer,
    StepInput,
    effective_size,
    hajek_step_metrics,
    hub_size,
    peer_uniforms,
    size_label,
)

__all__ = ["VAttention", "vattention_budget"]


def vattention_budget(e_base: np.ndarray, d_hat: float, R: int, epsilon: float,
                      delta: float, n_base: int) -> int:
    """The hub's per-head sample size ``b`` (see the module docstring, step 4)."""
    sigma = max(float(np.std(e_base, ddof=1)), 1e-8) if e_base.size > 1 else 1e-8
    z = float(special.ndtri(1.0 - delta))
    raw = (z * sigma * R / max(epsilon * d_hat, 1e-8)) ** 2
    b = int(np.floor(min(max(raw, 1.0), float(R))))
    return int(min(max(b, n_base), R))


@dataclass(frozen=True)
class VAttention(Peer):
    """vAttention's verified sampling; see the module docstring.

    Parameters
    ----------
    sinks, local : int
        Deterministic prefix and suffix (the hub's README config: 128 and 128).
    heavy : float or int
        Oracle top-k: a float is a fraction of N (``int(heavy N)``), an int a count; README
        config 0.1.
    base_rate : float
        Base sample rate (0.1).
    epsilon, delta : float
        The (epsilon, delta) target (0.25, 0.25).
    """

    name: ClassVar[str] = "vattention"

    sinks: int = 128
    local: int = 128
    heavy: float | int = 0.1
    base_rate: float = 0.1
    epsilon: float = 0.25
    delta: float = 0.25

    def __post_init__(self) -> None:
        self._check_ints(0, "sinks", "local")
        object.__setattr__(self, "heavy", hub_size(self.heavy, "vattention: heavy", 0))
        for f, lo, hi in (("base_rate", 0.0, 1.0), ("epsilon", 0.0, 1e9), ("delta", 0.0, 1.0)):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"vattention: {f} = {v!r}: expected a number")
            v = float(v)
            object.__setattr__(self, f, v)
            if not (np.isfinite(v) and lo < v < hi):
                raise ValueError(f"vattention: {f} = {v!r}: expected a number in ({lo}, {hi})")

    def label(self) -> str:
        return (f"vattention(sinks={self.sinks},local={self.local},heavy={size_label(self.heavy)},"
                f"base_rate={self.base_rate:g},epsilon={self.epsilon:g},delta={self.delta:g})")

    def deterministic(self, x: StepInput) -> np.ndarray:
        """The deterministic part over the ``n`` positions the layer holds (bool, (n,))."""
        n = x.n
        det = np.zeros(n, dtype=bool)
        det[:min(self.sinks, n)] = True
        det[max(0, n - self.local):] = True
        k = effective_size(self.heavy, n)
        rest = np.flatnonzero(~det)
        if k > 0 and rest.size:
            order = np.argsort(-x.logits[rest], kind="stable")[:k]
            det[rest[order]] = True
        return det

    def attend(self, x: StepInput, state, seed: int, z: float):
        n = x.n
        det = self.deterministic(x)
        start, end = self.sinks, n - self.local
        R = end - start
        # relative to the largest logit or sink; a sink is a take-all term of D (value zero)
        top = float(x.logits.max()) if x.sink is None else max(float(x.logits.max()), x.sink)
        e = np.exp(x.logits - top)
        e_sink = x.sink_weight(top)
        D = float(e.sum()) + e_sink
        # the hub's full-attention switches: its sink, local and top-k maskers, then R < 2
        if R < 2 or n <= effective_size(self.heavy, n):
            kept = np.ones(n, dtype=bool)
            row = hajek_step_metrics(x, np.ones(n), kept, z)
            row.update(kept_tokens=n, sampled=0, expected_sampled=0.0, budget_b=0,
                       peer_bound_ok=1.0, peer_den_ok=1.0)
            return row, row["estimate"], kept
        n_base = max(2, int(self.base_rate * R))
        ub = peer_uniforms(seed, x.layer, x.head, x.step, PURPOSE_VATT_BASE, n_base)
        base = start + np.minimum((ub * R).astype(np.int64), R - 1)
        d_hat = float(e[det].sum() + R / n_base * e[np.unique(base)].sum()) + e_sink
        b = vattention_budget(e[base], d_hat, R, self.epsilon, self.delta, n_base)
        uf = peer_uniforms(seed, x.layer, x.head, x.step, PURPOSE_VATT_FINAL, b)
        drawn = np.unique(start + np.minimum((uf * R).astype(np.int64), R - 1))
        sampled = np.zeros(n, dtype=bool)
        sampled[drawn] = True
        sampled &= ~det
        kept = det | sampled
        offset = np.zeros(n)
        offset[sampled] = np.log(R / b)
        own = hajek_step_metrics(x, np.ones(n), kept, z, logit_offset=offset, correction=False)
        # tracesim's Hájek estimate and certificate with the exact inclusion probabilities
        pi = np.ones(n)
        pi[start:end] = np.where(det[start:end], 1.0, 1.0 - (1.0 - 1.0 / R) ** b)
        ours = hajek_step_metrics(x, pi, kept, z)
        truth_norm = float(np.linalg.norm(x.truth))
        d_b = float((e * np.where(sampled, R / b, np.where(det, 1.0, 0.0))).sum()) + e_sink
        row = {"err2": own["err2"], "cert2": ours["cert2"], "wald_cov": ours["wald_cov"],
              "hajek_err2": ours["err2"], "tail_size": ours["tail_size"],
              "n_eff": ours["n_eff"], "kept_tokens": int(kept.sum()),
              "sampled": int(sampled.sum()), "expected_sampled": float(pi[start:end][
                  ~det[start:end]].sum()), "budget_b": b,
              "peer_bound_ok": float(np.sqrt(own["err2"]) <= self.epsilon * truth_norm),
              "peer_den_ok": float(abs(d_b - D) <= self.epsilon * D)}
        return row, own["estimate"], kept  # vAttention's own estimate
