"""Calibrating Tangram's fixed per-head budgets over a trace store.

It replays the base score over calibration sequences (hence it lives above the policies, beside
the replay that loads layers); :class:`tracesim.policies.tangram.TangramScore` then replays with
the ratios it returns, saved by :func:`tracesim.policies.tangram.save_tangram_profile`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tracesim.budgets import Budget, adakv_allocation, tangram_ratios
from tracesim.policies.composed import base_score
from tracesim.replay import load_layer

__all__ = ["calibrate_tangram"]


def calibrate_tangram(store: Any, base: str, budget: float, *, sinks: int = 4,
                      window: int = 32, alpha: float = 0.0,
                      sequences: list[str] | None = None) -> np.ndarray:
    """Per-(layer, KV head) ratios from Ada-KV's allocations on calibration sequences.

    For every calibration sequence and layer: the ``base`` score at the end of the compressed
    range, Ada-KV's per-head tail budgets (floor ``alpha``; the default 0 is one threshold over
    the layer's normalised scores, as Tangram's per-layer profiling scope) for the tail budget
    that ``budget`` (a fraction, as :class:`~tracesim.budgets.Budget`) leaves after sinks and
    window; then :func:`~tracesim.budgets.tangram_ratios` per layer over the sequences
    (median). Returns ``(n_layers, n_kv_heads)``.
    """
    score = base_score("calibrate_tangram", base, int(sinks), int(window))
    b = Budget(float(budget))
    ids = list(store.sequence_ids) if sequences is None else list(sequences)
    per_layer: list[list[np.ndarray]] = [[] for _ in range(store.model.n_layers)]
    for sid in ids:
        seq = store[sid]
        for layer in range(store.model.n_layers):
            trace = load_layer(store, seq, layer)
            end = score.compress_end(trace)
            tails = []
            for g in range(trace.n_kv_heads):
                take = score.take_all(trace, g, end)
                tails.append(score.scores(trace, g, end)[~take])
            take_n = int(score.take_all(trace, 0, end).sum())
            tb = max(0, score.kept_tokens(b, end) - take_n)
            per_layer[layer].append(adakv_allocation(tails, tb, float(alpha)))
    return np.stack([tangram_ratios(np.stack(rows)) for rows in per_layer])
