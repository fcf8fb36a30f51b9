"""Head roles (DuoAttention-style): retrieval heads keep the cache, streaming heads keep sinks
and a recent window.

Source: Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and
Streaming Heads", arXiv 2410.10819 (2024): a share of the heads (retrieval heads) need the
whole context; the others (streaming heads) need only the attention sinks and the recent
tokens, and get a constant-size cache. DuoAttention *learns* each head's role (a gate trained
on synthetic retrieval data, then thresholded); Forcing-KV (cited in the project seed) prunes
per head by role as well. tracesim has no training loop: it classifies each KV head from the
prefill with an attention-mass statistic instead (issue #33), documented in docs/scores.md.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from tracesim.budgets import role_allocation
from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score
from tracesim.policies.composed import base_score

__all__ = ["HeadRolesScore", "load_gates", "long_range_mass"]

MAX_GATES_BYTES = 16 << 20


@lru_cache(maxsize=8)
def load_gates(path: str) -> np.ndarray:
    """Field ``gates`` (n_layers, n_kv_heads) of an ``.npz``, values in [0, 1], validated; a
    ``ValueError`` names the file and the field."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"HeadRolesScore.gates = {path!r}: no such file (expected an .npz "
                         f"with a field 'gates' of shape (n_layers, n_kv_heads))")
    if p.stat().st_size > MAX_GATES_BYTES:
        raise ValueError(f"{path}: {p.stat().st_size} bytes, expected at most "
                         f"{MAX_GATES_BYTES}")
    try:
        with np.load(p, allow_pickle=False) as npz:
            if "gates" not in npz.files:
                raise ValueError(f"{path}: no field 'gates'; expected a float (n_layers, "
                                 f"n_kv_heads) array named 'gates'")
            gates = npz["gates"]
    except (OSError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: not a readable .npz without pickles ({exc})") from None
    if (gates.ndim != 2 or gates.dtype.kind != "f" or not np.isfinite(gates).all()
            or (gates < 0).any() or (gates > 1).any()):
        raise ValueError(f"{path}: field 'gates' (shape {gates.shape}, dtype {gates.dtype}): "
                         f"expected floats in [0, 1] of shape (n_layers, n_kv_heads)")
    return gates.astype(np.float64)


def long_range_mass(trace: LayerTrace, kv_head: int, end: int, sinks: int,
                    window: int) -> float:
    """Mean attention mass the stored prefill queries of the group put beyond sinks and window.

    For every stored query at a position ``p < end`` (the prefill: ``end`` is the end of the
    compressed range) and every query head of the group: the attention on keys
    ``[sinks, p + 1 - window)``, i.e. what a streaming cache of ``sinks`` + ``window`` tokens
    would lose at that query. Mean over queries and heads. Raises ``ValueError`` naming the
    sequence when no prefill query is stored.
    """
    idx = trace.indices_before(end)
    if idx.size == 0:
        raise ValueError(f"headroles: sequence {trace.sequence_id!r} stores no prefill query "
                         f"before position {end}; capture with a --window of at least 1")
    total, n = 0.0, 0
    for h in trace.group(kv_head):
        for i in idx:
            p = int(trace.query_positions[i])
            hi = p + 1 - window
            row = trace.attention(h, int(i))
            total += float(row[sinks:hi].sum()) if hi > sinks else 0.0
            n += 1
    return total / n


@dataclass(frozen=True)
class HeadRolesScore(Score):
    """Per-KV-head roles from the prefill; role budgets instead of one budget for all heads.

    A KV head is a *retrieval* head when :func:`long_range_mass` (its group's prefill
    attention beyond ``sinks`` + ``window``) is at least ``threshold``, else a *streaming*
    head. Every head keeps ``sinks`` and ``window`` take-all. A retrieval head's tail budget is
    the policy's (budget ``1.0``: the whole cache, DuoAttention's full attention; a smaller one
    samples or ranks its tail by the ``base`` score under the policy's design); a streaming
    head keeps ``streaming_tail`` tail tokens (0: exactly sinks + recent window, as
    DuoAttention; > 0: a small tail drawn by the same design, so the head's error is certified
    under a Poisson design). Roles are fixed at the end of the compressed range and kept at
    every later event.

    Parameters
    ----------
    base : str, default "h2o"
        Registry name of the score that ranks (or, under a randomized design, samples) tails.
    threshold : float in [0, 1], default 0.3
        Long-range attention mass (or gate value, with ``gates``) from which a head is a
        retrieval head.
    streaming_tail : int >= 0, default 0
        Tail tokens of a streaming head beyond its sinks and window.
    gates : str, default ""
        An ``.npz`` whose field ``gates`` (n_layers, n_kv_heads), values in [0, 1], replaces
        the attention-mass statistic: DuoAttention's learned per-head gate values (its released
        ``full_attention_heads.tsv``, converted), thresholded at ``threshold`` as its
        deployment does. Empty: classify from the prefill.
    """

    name: ClassVar[str] = "headroles"
    transform: ClassVar[str] = "the base score (>= 0 as is); per-head budgets by role"

    window: int = 32
    base: str = "h2o"
    threshold: float = 0.3
    streaming_tail: int = 0
    gates: str = ""

    def validate(self) -> None:
        if not 0.0 <= float(self.threshold) <= 1.0:
            raise ValueError(f"HeadRolesScore.threshold = {self.threshold}: expected [0, 1]")
        if self.streaming_tail < 0:
            raise ValueError(f"HeadRolesScore.streaming_tail = {self.streaming_tail}: "
                             f"expected an int >= 0")
        self.base_score()
        if self.gates:
            load_gates(str(self.gates))

    def base_score(self) -> Score:
        """The base score (the registry's, with this score's sinks and window)."""
        return base_score("HeadRolesScore", self.base, int(self.sinks), int(self.window))

    def compress_end(self, trace: LayerTrace) -> int:
        return self.base_score().compress_end(trace)

    def retrieval_heads(self, trace: LayerTrace) -> np.ndarray:
        """Bool per KV head: True for a retrieval head (classified on the prefill)."""
        if self.gates:
            g = load_gates(str(self.gates))
            if trace.layer >= g.shape[0] or g.shape[1] != trace.n_kv_heads:
                raise ValueError(f"{self.gates}: field 'gates' has shape {g.shape}; layer "
                                 f"{trace.layer} with {trace.n_kv_heads} KV heads needs "
                                 f"(> {trace.layer}, {trace.n_kv_heads})")
            return g[trace.layer] >= float(self.threshold)
        end = self.compress_end(trace)
        return np.array([long_range_mass(trace, g, end, int(self.sinks), int(self.window))
                         >= float(self.threshold) for g in range(trace.n_kv_heads)])

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        return self.base_score().scores(trace, kv_head, end)

    def check_budget(self, budget: Any) -> None:
        if budget.allocator != "uniform":
            raise ValueError(f"headroles sets each head's budget by its role; the budget's "
                             f"allocator is {budget.allocator!r}, expected 'uniform'")

    def tail_budgets(self, trace: LayerTrace, tail_scores: list[np.ndarray], tail_budget: int,
                     budget: Any) -> np.ndarray:
        self.check_budget(budget)
        return role_allocation(self.retrieval_heads(trace),
                               np.array([s.size for s in tail_scores], dtype=np.int64),
                               tail_budget, int(self.streaming_tail))
