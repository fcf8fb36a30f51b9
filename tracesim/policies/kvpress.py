"""NVIDIA kvpress names: the presses, the rules ported as scores, and the budget convention.

Every kvpress class name (``SnapKVPress``, ``KnormPress``, ...) is a score of its own that keeps
exactly the press's kept set with the ``topk`` design (:class:`KVPressRules`: kvpress's
truncated budget ``int(k_len * (1 - compression_ratio))``, the earlier token among equal
scores, and only the press's own protections); the registry names ``streaming_llm`` and
``observed_attention`` resolve to ``StreamingLLMPress`` and ``ObservedAttentionPress``. kvpress
names equal to a tracesim score (``snapkv``, ``tova``, ``knorm``, ``keydiff``, ``lagkv``,
``cur``, ``expected_attention``, ``random``) are the tracesim scores, with tracesim's
conventions. kvpress's ``compression_ratio`` is the fraction of the KV pairs removed, so
``budget = 1 - compression_ratio`` (see :func:`budget_from_compression_ratio`).
``docs/kvpress.md`` has the full table, the remaining differences and the presses that cannot
be replayed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from tracesim.layer_trace import LayerTrace
from tracesim.policies.cur import CURScore
from tracesim.policies.expected_attention import (
    ExpectedAttentionScore,
    average_rope,
    expected_attention,
    finish_scores,
    rope_inv_freq,
    unrotate,
)
from tracesim.policies.h2o import H2OScore
from tracesim.policies.keydiff import KeyDiffScore
from tracesim.policies.knorm import KNormScore
from tracesim.policies.lagkv import LagKVScore
from tracesim.policies.snapkv import SnapKVScore, pool1d
from tracesim.policies.streaming import StreamingScore
from tracesim.policies.tova import TOVAScore
from tracesim.policies.uniform import RandomScore

__all__ = ["KVPRESS_ALIASES", "KVPRESS_PRESSES", "KVPRESS_SCORES", "KVPressRules",
           "budget_from_compression_ratio"]

# ----------------------------------------------------------------------------- press rules

class KVPressRules:
    """The selection rules every kvpress press shares (``ScorerPress.compress``), as a mixin.

    * budget: ``n_kept = int(k_len * (1 - compression_ratio))`` -- truncated, where tracesim
      rounds; a fraction budget ``b`` keeps ``int(k_len * b)`` tokens per KV head (give the
      ratio as ``compression_ratio`` or ``b = 1 - ratio`` for the same float); token budgets
      are as in tracesim;
    * ties: among equal scores the earlier position is kept (``torch.topk`` leaves the order
      unspecified; CUDA's kernel takes equal values in index order, torch's CPU one another
      subset);
    * protections: only those of the press itself (no tracesim sinks or window by default);
      kvpress protects by giving the largest score, so a budget below the protected tokens
      keeps the earliest of them (``truncate_stratum``).
    """

    ties: ClassVar[str] = "earlier"
    truncate_stratum: ClassVar[bool] = True

    def kept_tokens(self, budget: Any, context: int) -> int:
        if budget.unit == "fraction":
            return int(min(context, int(context * float(budget.value))))
        return int(budget.tokens(context))


@dataclass(frozen=True)
class StreamingLLMPressScore(KVPressRules, StreamingScore):
    """kvpress ``StreamingLLMPress``: the first ``sinks`` (kvpress ``n_sink``, 4) tokens and
    the most recent ones, ``int(k_len (1 - ratio))`` in all."""

    name: ClassVar[str] = "StreamingLLMPress"

    sinks: int = 4
    window: int = 0


@dataclass(frozen=True)
class ObservedAttentionPressScore(KVPressRules, H2OScore):
    """kvpress ``ObservedAttentionPress``: the prefill attention each key received divided by
    the number of queries that saw it, averaged over the GQA group; nothing protected."""

    name: ClassVar[str] = "ObservedAttentionPress"

    sinks: int = 0
    window: int = 0
    normalize: bool = True


@dataclass(frozen=True)
class SnapKVPressScore(KVPressRules, SnapKVScore):
    """kvpress ``SnapKVPress(window_size=64, kernel_size=5)``.

    The last ``window`` queries' attention, averaged over them and the GQA group, is
    avg-pooled (zero padding) over the positions *before* the window only, ``[0, end -
    window)``, as kvpress pools its ``[..., :-window_size]`` slice; the window is kept
    (take-all; kvpress gives it the largest score). No sinks.
    """

    name: ClassVar[str] = "SnapKVPress"

    sinks: int = 0
    window: int = 64

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        idx = self.window_queries(trace, end)
        if idx.size == 0:
            raise ValueError(f"SnapKVPress: no stored query before position {end} in "
                             f"sequence {trace.sequence_id!r}")
        cut = max(0, end - self.window)
        att = trace.group_attention(kv_head, idx)[:cut]
        out = np.empty(end)
        out[:cut] = pool1d(att, self.kernel, self.pooling)
        out[cut:] = (out[:cut].max() if cut else 0.0) + 1.0
        return out


@dataclass(frozen=True)
class TOVAPressScore(KVPressRules, TOVAScore):
    """kvpress ``TOVAPress``: the last query's attention averaged over *all* query heads of the
    layer (one ranking for every KV head); the last token itself is kept (``window = 1``,
    kvpress gives it the largest score). ``tova`` keeps the per-group average."""

    name: ClassVar[str] = "TOVAPress"

    sinks: int = 0
    window: int = 1

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        idx = trace.indices_before(end)
        if idx.size == 0:
            raise ValueError(f"TOVAPress: no stored query before position {end}")
        acc = np.zeros(trace.n_positions)
        for g in range(trace.n_kv_heads):
            acc += trace.group_attention(g, idx[-1:])
        return acc[:end] / trace.n_kv_heads


@dataclass(frozen=True)
class KnormPressScore(KVPressRules, KNormScore):
    """kvpress ``KnormPress``: ``-‖k‖`` (as ``knorm``'s monotone transform); nothing
    protected."""

    name: ClassVar[str] = "KnormPress"

    sinks: int = 0
    window: int = 0


@dataclass(frozen=True)
class KeyDiffPressScore(KVPressRules, KeyDiffScore):
    """kvpress ``KeyDiffPress``: ``-cos(k, mean normalized key)`` (as ``1 - cos``); nothing
    protected."""

    name: ClassVar[str] = "KeyDiffPress"

    sinks: int = 0
    window: int = 0


@dataclass(frozen=True)
class LagKVPressScore(KVPressRules, LagKVScore):
    """kvpress ``LagKVPress(n_sink=4, lag_size=128)``.

    The first ``n_sink`` tokens and the last partition (with the remainder) score 1, like
    kvpress, and compete with each other for the budget (ties: the earlier token); they are not
    take-all (``sinks = 0``), because kvpress keeps only ``int(k_len (1 - ratio))`` of them
    when they outnumber the budget.
    """

    name: ClassVar[str] = "LagKVPress"

    sinks: int = 0
    window: int = 0
    n_sink: int = 4

    def validate(self) -> None:
        super().validate()
        if isinstance(self.n_sink, bool) or self.n_sink < 0:
            raise ValueError(f"LagKVPress.n_sink = {self.n_sink}: expected an int >= 0")

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        return self.lag_scores(trace, kv_head, end, self.n_sink)


@dataclass(frozen=True)
class CURPressScore(KVPressRules, CURScore):
    """kvpress ``CURPress``: as ``cur``; the ``sinks`` (kvpress ``num_sinks``, 4) are kept."""

    name: ClassVar[str] = "CURPress"


@dataclass(frozen=True)
class RandomPressScore(KVPressRules, RandomScore):
    """kvpress ``RandomPress``: uniform scores (tracesim's permanent random numbers, not a torch
    generator); nothing protected."""

    name: ClassVar[str] = "RandomPress"

    sinks: int = 0
    window: int = 0


@dataclass(frozen=True)
class ExpectedAttentionPressScore(KVPressRules, ExpectedAttentionScore):
    """kvpress ``ExpectedAttentionPress(n_future_positions=512, n_sink=4)``.

    The stored queries at positions ``[sinks, end)`` are rotated back to pre-RoPE with the
    store's RoPE settings (``model.json`` ``rope_theta`` / ``rope_scaling``), their mean and
    covariance are rotated by the RoPE matrix averaged over positions ``[end, end +
    n_future_positions)``, and ``softmax(k·mu/√d + kᵀΣk/(2d))`` is averaged over the group and
    rescaled by ``(x + epsilon) ‖v‖``; the sinks are kept. Refuses on stores without the RoPE
    settings.

    Parameters
    ----------
    n_future_positions : int, default 512
        kvpress's averaging range of the RoPE matrix.
    all_positions : bool, default True
        kvpress takes *every* query after the sinks: True requires all of them stored (stores
        captured with ``--all-positions``), else ``ValueError``; False uses the recorded ones
        (the windows; not kvpress's statistics).
    """

    name: ClassVar[str] = "ExpectedAttentionPress"

    n_future_positions: int = 512
    all_positions: bool = True

    def validate(self) -> None:
        super().validate()
        if isinstance(self.n_future_positions, bool) or self.n_future_positions < 1:
            raise ValueError(f"ExpectedAttentionPress.n_future_positions = "
                             f"{self.n_future_positions}: expected an int >= 1")
        if not isinstance(self.all_positions, bool):
            raise ValueError("ExpectedAttentionPress.all_positions must be a bool")

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        if trace.rope is None:
            raise ValueError(
                f"ExpectedAttentionPress: the store of sequence {trace.sequence_id!r} lacks the "
                "model's RoPE settings (model.json fields 'rope_theta' and 'rope_scaling', "
                "recorded by captures since they were added), so the stored post-RoPE queries "
                "cannot be rotated back as kvpress models them; re-capture the store with "
                "`tracesim capture` (add --all-positions for kvpress's every-query statistics), "
                "or use the tracesim score 'expected_attention' (post-RoPE stored queries)")
        lo = min(self.sinks, end - 1)
        idx = np.flatnonzero((trace.query_positions >= lo) & (trace.query_positions < end))
        if idx.size == 0:
            raise ValueError(f"ExpectedAttentionPress: no stored query in [{lo}, {end}) in "
                             f"sequence {trace.sequence_id!r}")
        if self.all_positions and idx.size < end - lo:
            raise ValueError(
                f"ExpectedAttentionPress: kvpress takes the statistics of every query at "
                f"positions [{lo}, {end}); sequence {trace.sequence_id!r} stores {idx.size} of "
                f"them. Capture with `tracesim capture --all-positions`, or pass "
                "all_positions=False to use the recorded queries (a documented difference)")
        d = trace.keys.shape[2]
        inv = rope_inv_freq(d, trace.rope)
        rot = average_rope(inv, end, self.n_future_positions)
        keys = trace.keys[kv_head, lo:end]
        heads = trace.group(kv_head)
        acc = np.zeros(end - lo)
        for h in heads:
            pre = unrotate(trace.queries[h, idx], trace.query_positions[idx], inv)
            acc += expected_attention(keys, pre @ rot.T, d**-0.5, self.use_covariance)
        return finish_scores(self, acc / len(heads), trace, kv_head, lo, end)


#: kvpress scoring rules ported as tracesim scores (built-ins, one module each).
KVPRESS_SCORES: dict[str, type] = {cls.name: cls for cls in (
    KeyDiffScore, LagKVScore, CURScore, ExpectedAttentionScore)}

#: The presses themselves, by kvpress class name: kvpress's kept set (its budget, ties and
#: protections; ``docs/kvpress.md``). Registered as built-in scores under these names.
KVPRESS_PRESSES: dict[str, type] = {cls.name: cls for cls in (
    StreamingLLMPressScore, ObservedAttentionPressScore, SnapKVPressScore, TOVAPressScore,
    KnormPressScore, RandomPressScore, KeyDiffPressScore, LagKVPressScore, CURPressScore,
    ExpectedAttentionPressScore)}
KVPRESS_SCORES.update(KVPRESS_PRESSES)

#: kvpress registry names that differ from both a tracesim score and a press class name ->
#: (score, presets). kvpress registry names equal to a tracesim score name (snapkv, tova,
#: knorm, random, keydiff, lagkv, cur, expected_attention) are the tracesim scores.
KVPRESS_ALIASES: dict[str, tuple[str, dict[str, Any]]] = {
    "streaming_llm": ("StreamingLLMPress", {}),
    "observed_attention": ("ObservedAttentionPress", {}),
}


def budget_from_compression_ratio(ratio: float) -> float:
    """kvpress ``compression_ratio`` (fraction removed, in [0, 1)) -> tracesim fraction budget.

    Raises
    ------
    ValueError
        Outside ``[0, 1)`` (kvpress's own range).
    """
    r = float(ratio)
    if not 0.0 <= r < 1.0:
        raise ValueError(f"compression_ratio = {ratio}: expected a number in [0, 1)")
    return 1.0 - r
