"""The recording attention function.

One function, registered under :data:`CAPTURE_ATTN` in transformers' ``AttentionInterface`` (with
a boolean causal mask function under the same name in ``AttentionMaskInterface``), serves every
attention layer of a model loaded with ``attn_implementation=CAPTURE_ATTN``. It delegates the
arithmetic to transformers' SDPA path (to the model's eager rule when the layer has a soft-cap
or sinks: :func:`tracesim.capture.variants.eager_attention`) and, when a :class:`CaptureState`
is attached to the model (:func:`recording`), records what attention saw:

- post-RoPE K and V of every fed position, per KV head (not repeated for GQA);
- Q and the per-head attention output before ``o_proj`` at the requested query positions;
- H2O statistics: the post-softmax attention each key received from all prefill queries, summed
  per query head and computed in query chunks, so memory stays ``O(chunk x kv_len)`` per head.

The state is attached to the attention modules of one model for the duration of one run, never
kept in a module-level global, so runs cannot leak into each other.

Enforcement extension points: :attr:`CaptureState.bias_fn` may return an additive fp32 bias per KV
head, ``(n_kv_heads, q_len, kv_len)`` (``-inf`` for evicted keys, ``-log pi`` for sampled tail
keys); it is broadcast over each GQA group and added to the causal mask before SDPA. A subclass
may re-plan a layer from the call's own query in :meth:`CaptureState.before_attention` (called
before the bias is asked for), and may also override :meth:`CaptureState.attend` to compute a
call's output itself (the one-pass certified decode attention does). Recording then sees the
enforced outputs. No eviction policy lives here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from tracesim.capture.variants import CallRule, bias_mask, eager_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

#: Name of the attention implementation; pass it as ``attn_implementation``.
CAPTURE_ATTN = "tracesim_capture"

#: Attribute under which a run's :class:`CaptureState` hangs on every attention module.
STATE_ATTR = "_tracesim_capture_state"

#: ``bias_fn(layer_idx, query_positions, kv_len) -> (n_kv_heads, q_len, kv_len) float32 | None``.
BiasFn = Callable[[int, torch.Tensor, int], "torch.Tensor | None"]


@dataclass
class LayerRecord:
    """What one layer recorded during one run (tensors stay on the model's device).

    Attributes
    ----------
    keys, values : torch.Tensor or None
        ``(n_kv_heads, kv_len, head_dim)``: the cache as seen by the latest call, i.e. every fed
        position once the run is over.
    positions : list of torch.Tensor
        Recorded query positions, one int64 tensor per call.
    queries, outputs : list of torch.Tensor
        ``(n_heads, n, head_dim)`` per call, parallel to ``positions``.
    h2o : torch.Tensor or None
        ``(n_heads, kv_len)`` float32 running sum of attention from prefill queries.
    """

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    positions: list[torch.Tensor] = field(default_factory=list)
    queries: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    h2o: torch.Tensor | None = None


@dataclass
class LayerArrays:
    """Finalized per-layer arrays in the trace store's layout (numpy, float32 unless noted).

    Attributes
    ----------
    keys, values : np.ndarray
        ``(n_kv_heads, n_positions, head_dim)``.
    queries, outputs : np.ndarray
        ``(n_heads, n_query, head_dim)``, rows sorted by query position.
    h2o : np.ndarray
        ``(n_heads, n_positions)`` float32; zero for keys no prefill query saw.
    positions : np.ndarray
        ``(n_query,)`` int64, sorted.
    """

    keys: np.ndarray
    values: np.ndarray
    queries: np.ndarray
    outputs: np.ndarray
    h2o: np.ndarray
    positions: np.ndarray


class CaptureState:
    """Per-run recording state, attached to a model's attention modules by :func:`recording`.

    Parameters
    ----------
    prompt_length : int
        Number of prompt tokens; queries at positions ``< prompt_length`` feed the H2O sums.
    record_positions : iterable of int, optional
        Absolute query positions whose Q and output are recorded.
    record_all : bool
        Record Q and output at every position (``record_positions`` is then ignored).
    record_from : int, optional
        Also record every position ``>= record_from`` (the decode steps), which are not known
        before generation ends.
    h2o_chunk : int
        Number of queries per chunk when accumulating H2O statistics.
    bias_fn : BiasFn, optional
        Enforcement hook, see the module docstring. ``None`` means full-cache attention.
    layers : iterable of int, optional
        Record only these layers (default every layer); the others run untouched.
    """

    def __init__(
        self,
        prompt_length: int,
        record_positions: Iterable[int] = (),
        *,
        record_all: bool = False,
        record_from: int | None = None,
        h2o_chunk: int = 256,
        bias_fn: BiasFn | None = None,
        layers: Iterable[int] | None = None,
    ) -> None:
        if prompt_length < 1:
            raise ValueError(f"prompt_length must be >= 1, got {prompt_length}")
        self.prompt_length = int(prompt_length)
        self.record_all = bool(record_all)
        self.record_from = record_from
        wanted = sorted({int(p) for p in record_positions})
        self._record_set = torch.tensor(wanted, dtype=torch.long)
        self.h2o_chunk = int(h2o_chunk)
        self.bias_fn = bias_fn
        self.only_layers = None if layers is None else frozenset(int(x) for x in layers)
        self.layers: dict[int, LayerRecord] = {}
        #: layer -> the soft-cap, sinks and window the model passed to its attention.
        self.rules: dict[int, CallRule] = {}
        # Positions the caller is about to feed, [start, stop); checked against the cache so that a
        # cache that drops tokens (sliding windows) cannot silently produce a wrong trace.
        self.step: tuple[int, int] | None = None

    def rule(self, layer: int) -> CallRule:
        """The soft-cap, sinks and window of ``layer``'s latest call (none before its first)."""
        return self.rules.get(layer, CallRule())

    def begin_step(self, start: int, stop: int) -> None:
        """Declare that the next forward feeds absolute positions ``start..stop-1``."""
        self.step = (int(start), int(stop))

    def _selected(self, positions: torch.Tensor) -> torch.Tensor:
        """Indices into ``positions`` (``(q_len,)`` int64, CPU) whose Q/output are recorded."""
        if self.record_all:
            return torch.arange(positions.numel())
        keep = torch.isin(positions, self._record_set)
        if self.record_from is not None:
            keep |= positions >= self.record_from
        return torch.nonzero(keep).flatten()

    def bias(self, layer: int, positions: torch.Tensor, kv_len: int) -> torch.Tensor | None:
        """The enforcement bias for this call, ``(n_kv_heads, q_len, kv_len)``, or None."""
        return None if self.bias_fn is None else self.bias_fn(layer, positions, kv_len)

    def before_attention(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        """Called first in every attention call of ``layer``, with the call's query and cache.

        The default does nothing; a per-step design re-plans the layer here from the step's
        own query (:class:`tracesim.capture.inloop.perstep.PerStepState`), before :meth:`bias` and
        :meth:`attend` read the plan. Shapes as in :meth:`record`.
        """

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor | None:
        """Compute this call's attention output ``(1, q_len, H, D)`` instead of SDPA, or None.

        The default defers to SDPA;
        :class:`tracesim.capture.inloop.enforce.EvictionState` computes decode steps
        itself so that their certificates come out of the same pass.
        """
        return None

    def record(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float,
    ) -> None:
        """Record one attention call of ``layer`` (shapes as the attention function gets them).

        ``query`` is ``(1, H, q_len, D)``, ``key``/``value`` ``(1, H_kv, kv_len, D)``, ``output``
        ``(1, q_len, H, D)`` and ``mask`` a boolean ``(1, 1, q_len, kv_len)`` (True = attend).
        """
        if query.shape[0] != 1:
            raise ValueError(f"capture records batch size 1, got {query.shape[0]}")
        if self.only_layers is not None and layer not in self.only_layers:
            return
        q_len, kv_len = query.shape[2], key.shape[2]
        if self.step is not None and self.step != (kv_len - q_len, kv_len):
            raise RuntimeError(
                f"layer {layer}: the cache holds {kv_len} positions for queries {self.step}; "
                "capture needs a full (non-sliding) cache"
            )
        rec = self.layers.setdefault(layer, LayerRecord())
        rec.keys, rec.values = key[0].detach(), value[0].detach()
        positions = torch.arange(kv_len - q_len, kv_len)
        idx = self._selected(positions)
        if idx.numel():
            dev_idx = idx.to(query.device)
            rec.positions.append(positions[idx])
            rec.queries.append(query[0].index_select(1, dev_idx).detach())
            rec.outputs.append(output[0].index_select(0, dev_idx).transpose(0, 1).detach())
        n_prefill = min(q_len, self.prompt_length - (kv_len - q_len))
        if n_prefill > 0:
            prefill_q = query[0, :, :n_prefill]
            self._accumulate_h2o(rec, prefill_q, key[0], mask, scaling, kv_len - q_len,
                                 *self.rule(layer)[:2])

    def _accumulate_h2o(
        self,
        rec: LayerRecord,
        query: torch.Tensor,
        key: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float,
        q_offset: int,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Add the post-softmax attention of prefill queries ``(H, n, D)`` over ``key`` (after
        the soft-cap; a sink's share goes to no key)."""
        n_heads, n_q, head_dim = query.shape
        n_kv, kv_len = key.shape[0], key.shape[1]
        group = n_heads // n_kv
        acc = torch.zeros(n_heads, kv_len, dtype=torch.float32, device=query.device)
        k32 = key.float().transpose(1, 2)  # (H_kv, D, kv_len); GQA groups share it, no repeat
        kv_pos = torch.arange(kv_len, device=query.device)
        for a in range(0, n_q, self.h2o_chunk):
            b = min(n_q, a + self.h2o_chunk)
            # Causal: keys after the chunk's last query get no attention, so skip them (halves
            # the work of a one-shot prefill).
            stop = min(kv_len, q_offset + b)
            q32 = query[:, a:b].float().reshape(n_kv, group, b - a, head_dim)
            logits = torch.matmul(q32, k32[:, None, :, :stop]) * scaling  # (H_kv, g, c, stop)
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            if mask is not None:
                allowed = mask[0, 0, a:b, :stop]
            else:
                q_pos = torch.arange(q_offset + a, q_offset + b, device=query.device)
                allowed = kv_pos[None, :stop] <= q_pos[:, None]
            logits = logits.masked_fill(~allowed, float("-inf"))
            if sinks is not None:
                sink = sinks.float().reshape(n_kv, group, 1, 1).expand(-1, -1, b - a, 1)
                probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
            else:
                probs = torch.softmax(logits, dim=-1)
            acc[:, :stop] += probs.sum(dim=2).reshape(n_heads, stop)
        if rec.h2o is None:
            rec.h2o = acc
        else:
            # A later prefill chunk sees more keys; earlier sums cover a prefix of them.
            acc[:, : rec.h2o.shape[1]] += rec.h2o
            rec.h2o = acc

    def finalize(self) -> list[LayerArrays]:
        """Per-layer numpy arrays in layer order, float32 (H2O padded with zeros to kv_len)."""
        out = []
        for layer in sorted(self.layers):
            rec = self.layers[layer]
            if rec.keys is None:
                raise RuntimeError(f"layer {layer} recorded nothing")
            if rec.h2o is None:
                raise RuntimeError(f"layer {layer} saw no prefill query")
            n_pos = rec.keys.shape[1]
            n_heads = rec.h2o.shape[0]
            h2o = np.zeros((n_heads, n_pos), np.float32)
            h2o[:, : rec.h2o.shape[1]] = rec.h2o.cpu().numpy()
            if rec.positions:
                pos = torch.cat(rec.positions)
                order = torch.argsort(pos)
                q = torch.cat([t.float().cpu() for t in rec.queries], dim=1)[:, order]
                o = torch.cat([t.float().cpu() for t in rec.outputs], dim=1)[:, order]
                pos = pos[order]
            else:
                head_dim = rec.keys.shape[2]
                q = o = torch.zeros(n_heads, 0, head_dim)
                pos = torch.zeros(0, dtype=torch.long)
            out.append(
                LayerArrays(
                    keys=rec.keys.float().cpu().numpy(),
                    values=rec.values.float().cpu().numpy(),
                    queries=q.numpy(),
                    outputs=o.numpy(),
                    h2o=h2o,
                    positions=pos.numpy(),
                )
            )
        return out


def capture_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention that records into the module's :class:`CaptureState`, if one is attached.

    Shapes: ``query (B, H, q_len, D)``, ``key``/``value`` ``(B, H_kv, kv_len, D)`` post-RoPE with
    the cache included, ``attention_mask`` boolean ``(B, 1, q_len, kv_len)``; returns
    ``(B, q_len, H, D)``.
    """
    state: CaptureState | None = getattr(module, STATE_ATTR, None)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    softcap, sinks = kwargs.pop("softcap", None), kwargs.pop("s_aux", None)
    if state is None:
        if softcap is not None or sinks is not None:
            return eager_attention(query, key, value, attention_mask, scaling, softcap,
                                   sinks), None
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer = int(module.layer_idx)
    state.rules[layer] = CallRule(softcap, None if sinks is None else sinks.detach(),
                                  kwargs.get("sliding_window"))
    q_len, kv_len = query.shape[2], key.shape[2]
    mask = attention_mask
    state.before_attention(layer, query, key, value)
    bias = state.bias(layer, torch.arange(kv_len - q_len, kv_len), kv_len)
    if bias is not None:
        group = query.shape[1] // key.shape[1]
        mask = bias_mask(attention_mask, bias.to(query.device), group, q_len, query.dtype)
    out = state.attend(layer, query, key, value, float(scaling))
    weights = None
    if out is None and (softcap is not None or sinks is not None):
        out = eager_attention(query, key, value, mask, scaling, softcap, sinks)
    elif out is None:
        out, weights = sdpa_attention_forward(
            module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs
        )
    state.record(layer, query, key, value, out, attention_mask, float(scaling))
    return out, weights


def capture_mask(*args, **kwargs) -> torch.Tensor | None:
    """SDPA's boolean mask, always materialized so recording and bias see the real pattern."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Register the attention and mask functions (idempotent); returns :data:`CAPTURE_ATTN`."""
    AttentionInterface.register(CAPTURE_ATTN, capture_attention_forward)
    AttentionMaskInterface.register(CAPTURE_ATTN, capture_mask)
    return CAPTURE_ATTN


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Self-attention modules (those with ``layer_idx`` and ``o_proj``) in layer order."""
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    if not mods:
        raise ValueError(f"{type(model).__name__} has no attention modules with layer_idx/o_proj")
    return sorted(mods, key=lambda m: int(m.layer_idx))


@contextlib.contextmanager
def recording(model: torch.nn.Module, state: CaptureState) -> Iterator[CaptureState]:
    """Attach ``state`` to every attention module of ``model`` for the duration of the block."""
    if model.config._attn_implementation != CAPTURE_ATTN:
        raise ValueError(
            f"model uses attn_implementation={model.config._attn_implementation!r}; "
            f"load it with {CAPTURE_ATTN!r} (tracesim.capture.models.load_model does)"
        )
    mods = attention_modules(model)
    for m in mods:
        setattr(m, STATE_ATTR, state)
    try:
        yield state
    finally:
        for m in mods:
            if getattr(m, STATE_ATTR, None) is state:
                delattr(m, STATE_ATTR)


register()
