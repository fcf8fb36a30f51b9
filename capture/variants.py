"""Which attention a model computes, read from its config before any forward pass.

A trace store records the rule that produced its outputs (``docs/trace-format.md``, "Attention
variants"): per layer full or sliding attention with its window, the attention-logit soft-cap
and learned sink logits. This module knows, per supported ``model_type``, where transformers
keeps those settings, and refuses any other architecture or attention variant by name (a
:class:`UnsupportedModel`, a ``ValueError``: ``tracesim capture`` exits 2) before a token runs,
so that a capture never writes a trace of a computation it does not understand.

How each family decides a layer's window (transformers' own modeling code):

- ``layer_types``: Qwen 2/3, Gemma 2/3 and gpt-oss build one mask per entry of
  ``config.layer_types`` (``full_attention`` / ``sliding_attention``, window
  ``config.sliding_window``);
- ``global``: Mistral, Phi-3 and Qwen3-MoE use a sliding mask on every layer when
  ``config.sliding_window`` is set, else a causal one;
- ``full``: Llama and OLMo 2 only ever build a causal mask.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

#: Supported ``model_type`` -> how it decides the layer windows (see the module docstring).
SUPPORTED_MODEL_TYPES = {
    "llama": "full",
    "olmo2": "full",
    "mistral": "global",
    "phi3": "global",
    "qwen3_moe": "global",
    "qwen2": "layer_types",
    "qwen3": "layer_types",
    "gemma2": "layer_types",
    "gemma3_text": "layer_types",
    "gpt_oss": "layer_types",
}
#: ``config.layer_types`` entries with a recorded meaning.
_LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}
#: Config attributes of attention variants no supported family handles; set (non-null) they
#: are refused. ``attention_chunk_size``: Llama 4's chunked attention.
_UNHANDLED_ATTRIBUTES = ("attention_chunk_size",)


class CallRule(NamedTuple):
    """What a model passed its attention function for one layer: soft-cap, sink logits
    ``(H,)`` (a tensor) and sliding window, each None when the layer has none."""

    softcap: float | None = None
    sinks: Any = None
    window: int | None = None

    @property
    def plain_logits(self) -> bool:
        """No soft-cap and no sinks: logits and normalizer as in plain softmax attention."""
        return self.softcap is None and self.sinks is None


class UnsupportedModel(ValueError):
    """The model's architecture or one of its attention variants is not handled by capture."""


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def check_supported(config: Any) -> None:
    """Refuse, naming it, an architecture or attention variant capture does not handle.

    Raises
    ------
    UnsupportedModel
        For an unknown ``model_type``, an unknown ``layer_types`` entry or a set attribute of
        an unhandled variant.
    """
    cfg = _text_config(config)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported by capture; supported: "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))} (docs/capture.md)")
    for name in _UNHANDLED_ATTRIBUTES:
        if getattr(cfg, name, None) is not None:
            raise UnsupportedModel(f"model_type {model_type!r}: config field {name!r} = "
                                   f"{getattr(cfg, name)!r} is an attention variant capture "
                                   "does not handle")
    if SUPPORTED_MODEL_TYPES[model_type] == "layer_types":
        kinds = list(getattr(cfg, "layer_types", None) or [])
        unknown = sorted({k for k in kinds if k not in _LAYER_KINDS})
        if unknown:
            raise UnsupportedModel(f"model_type {model_type!r}: config field 'layer_types' "
                                   f"holds {unknown}, expected only {sorted(_LAYER_KINDS)}")
        if "sliding_attention" in kinds and not _window_ok(getattr(cfg, "sliding_window", None)):
            raise UnsupportedModel(f"model_type {model_type!r}: sliding layers with "
                                   f"sliding_window = {cfg.sliding_window!r}, expected an int "
                                   ">= 1")
    elif SUPPORTED_MODEL_TYPES[model_type] == "global":
        window = getattr(cfg, "sliding_window", None)
        if window is not None and not _window_ok(window):
            raise UnsupportedModel(f"model_type {model_type!r}: sliding_window = {window!r}, "
                                   "expected null or an int >= 1")


def _window_ok(window: Any) -> bool:
    return isinstance(window, int) and not isinstance(window, bool) and window >= 1


def layer_attention(config: Any, n_layers: int) -> list[dict[str, Any]] | None:
    """Per layer ``{"kind", "window"}`` as the model masks it; ``None`` when every layer is full.

    Raises
    ------
    UnsupportedModel
        As :func:`check_supported`, or when ``layer_types`` does not cover ``n_layers``.
    """
    check_supported(config)
    cfg = _text_config(config)
    how = SUPPORTED_MODEL_TYPES[cfg.model_type]
    window = getattr(cfg, "sliding_window", None)
    if how == "full" or (how == "global" and window is None):
        return None
    if how == "global":
        kinds = ["sliding"] * n_layers
    else:
        types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n_layers)
        if len(types) != n_layers:
            raise UnsupportedModel(f"model_type {cfg.model_type!r}: config field 'layer_types' "
                                   f"has {len(types)} entries for {n_layers} layers")
        kinds = [_LAYER_KINDS[t] for t in types]
    if all(k == "full" for k in kinds):
        return None
    return [{"kind": k, "window": int(window) if k == "sliding" else None} for k in kinds]


def attention_variants(model: Any) -> dict[str, Any]:
    """The ``ModelMeta`` fields ``layer_attention``, ``attn_logit_softcap`` and ``sinks`` of a
    loaded model, for every model layer and query head (subsets are sliced by the caller).

    The soft-cap is the attention modules' ``attn_logit_softcapping`` (what they pass to the
    attention function), the sinks their ``sinks`` parameters (gpt-oss's ``s_aux``).
    """
    from tracesim.capture.attention import attention_modules

    mods = attention_modules(model)
    caps = {getattr(m, "attn_logit_softcapping", None) for m in mods}
    if len(caps) != 1:
        raise UnsupportedModel("layers disagree on attn_logit_softcapping: "
                               f"{sorted(map(str, caps))}")
    softcap = caps.pop()
    sinks = None
    if any(getattr(m, "sinks", None) is not None for m in mods):
        if not all(getattr(m, "sinks", None) is not None for m in mods):
            raise UnsupportedModel("only some layers have attention sinks")
        sinks = [[float(x) for x in m.sinks.detach().float().cpu().flatten()] for m in mods]
    return dict(layer_attention=layer_attention(model.config, len(mods)),
                attn_logit_softcap=None if softcap is None else float(softcap), sinks=sinks)


def subset_variants(variants: dict[str, Any], layers: list[int], heads: list[int]
                    ) -> dict[str, Any]:
    """``variants`` restricted to the stored ``layers`` and query ``heads`` (model indices)."""
    la, sinks = variants["layer_attention"], variants["sinks"]
    if la is not None:
        la = [la[i] for i in layers]
        if all(e["kind"] == "full" for e in la):
            la = None
    if sinks is not None:
        sinks = [[sinks[i][h] for h in heads] for i in layers]
    return dict(layer_attention=la, attn_logit_softcap=variants["attn_logit_softcap"],
                sinks=sinks)


def eager_attention(query: Any, key: Any, value: Any, mask: Any, scaling: float,
                    softcap: float | None = None, sinks: Any = None) -> Any:
    """Attention with a soft-cap and/or sinks, as transformers' eager code of gemma2 / gpt-oss
    computes it (SDPA has neither): logits ``scaling * q k^T``, then ``softcap * tanh(./softcap)``,
    then the mask; with ``sinks`` (``(H,)``) a sink column joins the softmax and is dropped.

    Shapes: ``query (B, H, q, D)``, ``key``/``value`` ``(B, H_kv, kv, D)``, ``mask`` boolean
    (True = attend) or additive, broadcastable to ``(B, H, q, kv)``, or None (causal); returns
    ``(B, q, H, D)``.
    """
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1)
    v = value.repeat_interleave(group, dim=1)
    logits = torch.matmul(query, k.transpose(2, 3)) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    q_len, kv_len = query.shape[2], key.shape[2]
    if mask is None:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
        mask = torch.arange(kv_len, device=query.device)[None, :] <= q_pos[:, None]
    if mask.dtype == torch.bool:
        logits = logits.masked_fill(~mask, float("-inf"))
    else:
        logits = logits + mask.to(logits.dtype)
    if sinks is None:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    else:
        sink = sinks.reshape(1, -1, 1, 1).to(logits.dtype).expand(*logits.shape[:3], 1)
        combined = torch.cat([logits, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(v.dtype)
    return torch.matmul(probs, v).transpose(1, 2).contiguous()


def bias_mask(mask: Any, bias: Any, group: int, q_len: int, dtype: Any) -> Any:
    """Fold a per-KV-head bias ``(H_kv, q_len, kv_len)`` into an additive ``(1, H, q, kv)`` mask
    (the model's boolean ``mask``, a sliding window included, sets ``-inf`` where it forbids)."""
    full = bias.float().repeat_interleave(group, dim=0)[None]
    if mask is not None:
        full = full.masked_fill(~mask.bool(), float("-inf"))
    else:
        kv_len = bias.shape[-1]
        q_pos = torch.arange(kv_len - q_len, kv_len, device=bias.device)
        causal = torch.arange(kv_len, device=bias.device)[None, :] <= q_pos[:, None]
        full = full.masked_fill(~causal, float("-inf"))
    # SDPA wants the mask in the query dtype; fp32 models keep -log(pi) exactly.
    return full.to(dtype)
