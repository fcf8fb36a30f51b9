"""Cache budgets per (layer, KV head): uniform, Ada-KV and PyramidKV allocation.

A budget is the number of tokens of the compressible range a KV head keeps, take-all stratum
included. It is given as a fraction of the compressible range (the *context*: the prompt, or the
text before the question for question-agnostic compression) or as absolute tokens. Allocators
redistribute the *tail* budget (budget minus the position-based take-all tokens, identical
across heads) while keeping its total:

``uniform``
    every (layer, KV head) gets the nominal budget;
``adakv``
    within a layer, each head first gets ``alpha`` of the per-head tail budget, the rest goes to
    the globally highest tail scores after normalising each head's scores to sum 1
    (Ada-KV, Feng et al. 2024, with its safeguard floor);
``pyramidkv``
    a linear per-layer schedule from ``2 T - T/beta`` at layer 0 to ``T/beta`` at the last
    layer (mean ``T`` over layers), uniform across the heads of a layer (PyramidKV, Cai et al.
    2024, ``beta = 20``).

Two more allocators are functions here, not ``Budget.allocator`` values:

``role_allocation``
    head roles (DuoAttention-style, :mod:`tracesim.policies.headroles`): retrieval heads get
    the per-head tail budget, streaming heads a fixed small one (sinks + window only by
    default); the ``headroles`` score applies it.
``tangram_allocation``
    Tangram (Kim et al. 2026, arXiv 2606.06302): *static* per-head budgets, fixed before the
    input is seen from per-head ratios calibrated offline (:func:`tangram_ratios`, e.g. over
    Ada-KV's allocations on calibration sequences), where Ada-KV re-allocates on every input.

Allocations are integers; with randomized designs the *expected* kept count equals the budget
and the realized count varies by seed (the replay reports both).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ALLOCATORS", "Budget", "adakv_allocation", "largest_remainder", "pyramid_allocation",
           "role_allocation", "tangram_allocation", "tangram_ratios"]

ALLOCATORS = ("uniform", "adakv", "pyramidkv")
UNITS = ("fraction", "tokens")


@dataclass(frozen=True)
class Budget:
    """A nominal cache budget and how it is spread over heads and layers.

    Parameters
    ----------
    value : float
        Fraction of the compressible range in (0, 1] (``unit="fraction"``), or tokens >= 1.
    unit : {"fraction", "tokens"}
    allocator : {"uniform", "adakv", "pyramidkv"}
    alpha : float, default 0.2
        Ada-KV's per-head floor, as a fraction of the per-head tail budget.
    beta : float, default 20
        PyramidKV's ratio: the last layer gets ``1/beta`` of the mean tail budget.
    """

    value: float
    unit: str = "fraction"
    allocator: str = "uniform"
    alpha: float = 0.2
    beta: float = 20.0

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"Budget.unit = {self.unit!r}: expected one of {UNITS}")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"Budget.allocator = {self.allocator!r}: expected one of {ALLOCATORS}")
        v = float(self.value)
        if self.unit == "fraction" and not 0.0 < v <= 1.0:
            raise ValueError(f"Budget.value = {self.value}: a fraction must lie in (0, 1]")
        if self.unit == "tokens" and not (v >= 1.0 and v == round(v)):
            raise ValueError(f"Budget.value = {self.value}: a token budget must be an int >= 1")
        if not 0.0 <= float(self.alpha) <= 1.0:
            raise ValueError(f"Budget.alpha = {self.alpha}: expected [0, 1]")
        if not float(self.beta) >= 1.0:
            raise ValueError(f"Budget.beta = {self.beta}: expected >= 1")

    def tokens(self, context: int) -> int:
        """Nominal tokens per (layer, KV head) for a compressible range of ``context`` tokens."""
        if self.unit == "fraction":
            return int(min(context, max(1, round(float(self.value) * context))))
        return int(min(context, int(self.value)))

    def label(self) -> str:
        """Stable string, e.g. ``uniform:0.25`` or ``adakv(alpha=0.2):512tok``."""
        amount = f"{float(self.value):g}" if self.unit == "fraction" else f"{int(self.value)}tok"
        if self.allocator == "adakv":
            return f"adakv(alpha={float(self.alpha):g}):{amount}"
        if self.allocator == "pyramidkv":
            return f"pyramidkv(beta={float(self.beta):g}):{amount}"
        return f"uniform:{amount}"

    def layer_tail_budget(self, tail_budget: int, layer: int, n_layers: int) -> int:
        """This layer's per-head tail budget (PyramidKV schedule; the identity otherwise)."""
        if self.allocator != "pyramidkv":
            return int(tail_budget)
        return int(pyramid_allocation(tail_budget, n_layers, float(self.beta))[layer])

    def allocate(self, tail_scores: list[np.ndarray], tail_budget: int) -> np.ndarray:
        """Per-head tail budgets of one layer from the heads' tail scores (Ada-KV or uniform).

        Parameters
        ----------
        tail_scores : list of ndarray, one per KV head, shape (N_g,)
            Non-negative scores of each head's tail tokens.
        tail_budget : int
            Per-head tail budget of this layer (after the PyramidKV schedule).

        Returns
        -------
        ndarray of int64, shape (n_kv_heads,)
            Capped at each head's tail size.
        """
        sizes = np.array([s.size for s in tail_scores], dtype=np.int64)
        if self.allocator == "adakv":
            return adakv_allocation(tail_scores, tail_budget, float(self.alpha))
        return np.minimum(sizes, max(0, int(tail_budget)))


def pyramid_allocation(tail_budget: int, n_layers: int, beta: float = 20.0) -> np.ndarray:
    """PyramidKV's linear schedule of per-head tail budgets over layers, shape (n_layers,).

    Layer ``l`` gets ``max - l (max - min) / (n_layers - 1)`` with ``min = T / beta`` and
    ``max = 2 T - min``, rounded by largest remainder so the total is ``n_layers * T``.
    """
    T = float(max(0, tail_budget))
    if n_layers == 1:
        return np.array([int(T)], dtype=np.int64)
    lo = T / beta
    hi = 2.0 * T - lo
    exact = hi - np.arange(n_layers) * (hi - lo) / (n_layers - 1)
    base = np.floor(exact).astype(np.int64)
    short = int(round(n_layers * T)) - int(base.sum())
    # Largest remainder; ties go to the earlier layer so the result is deterministic.
    order = np.argsort(-(exact - base), kind="stable")
    base[order[:max(0, short)]] += 1
    return base


def adakv_allocation(tail_scores: list[np.ndarray], tail_budget: int,
                     alpha: float = 0.2) -> np.ndarray:
    """Ada-KV: floor ``alpha * T`` per head, the rest by global top-k of normalised scores.

    Each head's scores are divided by their sum (so heads compare on attention *shares*); the
    head's own top ``floor`` tokens are already paid by its floor, and the remaining
    ``n_kv * T - sum(floors)`` slots go to the highest normalised scores over all heads (ties:
    lower head, then earlier token). Returns per-head tail budgets summing to ``n_kv * T``
    (less only when the heads' tails cannot hold it).
    """
    n_kv = len(tail_scores)
    T = max(0, int(tail_budget))
    sizes = np.array([s.size for s in tail_scores], dtype=np.int64)
    floors = np.minimum(sizes, int(np.floor(alpha * T)))
    remaining = n_kv * T - int(floors.sum())
    cand_scores, cand_heads = [], []
    for g, s in enumerate(tail_scores):
        x = np.asarray(s, dtype=np.float64)
        total = x.sum()
        x = x / total if total > 0 else np.full(x.size, 1.0 / max(1, x.size))
        rest = np.sort(x)[::-1][floors[g]:]
        cand_scores.append(rest)
        cand_heads.append(np.full(rest.size, g, dtype=np.int64))
    alloc = floors.copy()
    if remaining > 0 and cand_scores:
        scores = np.concatenate(cand_scores)
        heads = np.concatenate(cand_heads)
        take = np.argsort(-scores, kind="stable")[:remaining]
        alloc += np.bincount(heads[take], minlength=n_kv)
    return alloc


def largest_remainder(exact: np.ndarray, total: int) -> np.ndarray:
    """Integers ``floor(exact)`` plus one for the ``total - sum(floor)`` largest remainders
    (ties: the earlier index), so they sum to ``total`` (``exact`` must sum to it)."""
    exact = np.asarray(exact, dtype=np.float64)
    base = np.floor(exact).astype(np.int64)
    short = int(total) - int(base.sum())
    order = np.argsort(-(exact - base), kind="stable")
    base[order[:max(0, short)]] += 1
    return base


def role_allocation(retrieval: np.ndarray, sizes: np.ndarray, tail_budget: int,
                    streaming_tail: int = 0) -> np.ndarray:
    """Per-head tail budgets by role: ``tail_budget`` for a retrieval head, ``streaming_tail``
    for a streaming head, each capped at the head's tail size ``sizes``."""
    want = np.where(np.asarray(retrieval, dtype=bool), max(0, int(tail_budget)),
                    max(0, int(streaming_tail)))
    return np.minimum(np.asarray(sizes, dtype=np.int64), want.astype(np.int64))


def tangram_ratios(allocations: np.ndarray) -> np.ndarray:
    """Tangram's per-head budget ratios from calibration allocations.

    ``allocations`` (n_samples, n_heads): a non-uniform method's per-head budgets on each
    calibration sample (Tangram calibrates from ~50 samples). Each row is divided by its mean
    (so a head's ratio says how much more than the average head it keeps on that sample); the
    ratio of a head is the median over samples (Tangram's public profiling tool aggregates
    per-head retention by its median), renormalised to mean 1. Heads with no budget on every
    sample get 0.
    """
    a = np.asarray(allocations, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1 or not np.isfinite(a).all() or (
            a < 0).any():
        raise ValueError(f"tangram_ratios: allocations of shape {a.shape}: expected a "
                         f"non-negative finite (n_samples, n_heads) array")
    means = a.mean(axis=1, keepdims=True)
    rel = np.divide(a, means, out=np.ones_like(a), where=means > 0)
    r = np.median(rel, axis=0)
    return r / r.mean() if r.mean() > 0 else np.ones(a.shape[1])


def tangram_allocation(ratios: np.ndarray, tail_budget: int,
                       sizes: np.ndarray | None = None) -> np.ndarray:
    """Static per-head tail budgets ``ratios * T`` (ratios of mean 1), largest remainder so the
    total is ``n_heads * T``, capped at each head's tail size (``sizes``, if given). The same on
    every input: the scores are not read."""
    r = np.asarray(ratios, dtype=np.float64)
    if r.ndim != 1 or not np.isfinite(r).all() or (r < 0).any() or r.sum() <= 0:
        raise ValueError("tangram_allocation: ratios must be a non-negative finite 1-D array "
                         "with a positive sum")
    T = max(0, int(tail_budget))
    exact = r * (r.size * T) / r.sum()
    alloc = largest_remainder(exact, r.size * T)
    return alloc if sizes is None else np.minimum(np.asarray(sizes, dtype=np.int64), alloc)
