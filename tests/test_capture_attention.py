"""The recording attention function on tiny config-built GQA models of every supported family."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from tracesim.capture.attention import STATE_ATTR, CaptureState, attention_modules, recording
from tracesim.capture.generate import greedy_generate
from tracesim.capture.models import set_attention, tiny_model
from tracesim.capture.variants import attention_variants

from tracesim.attention_rule import layer_window

pytestmark = pytest.mark.capture

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
PROMPT_LEN, N_NEW = 40, 6
TOL = 1e-5


def _prompt(seed: int = 1, n: int = PROMPT_LEN, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _capture(model, prompt, **kw):
    prefill_chunk = kw.pop("prefill_chunk", 2048)
    state = CaptureState(len(prompt), **kw)
    with recording(model, state):
        gen = greedy_generate(model, prompt, N_NEW, state=state, prefill_chunk=prefill_chunk)
    return gen, state.finalize()


def _eager_reference(model, prompt, n_new):
    """HF eager attention run through the same greedy loop (prefill, then cached decode).

    Returns per-layer pre-``o_proj`` outputs ``(n_fed, H, D)`` (caught on the o_proj input), the
    prefill attention weights ``(H, P, P)`` per layer, and the generation.
    """
    set_attention(model, "eager")
    caught: dict[int, list[torch.Tensor]] = {}
    mods = attention_modules(model)
    hooks = [
        m.o_proj.register_forward_hook(
            lambda mod, inp, out, i=i: caught.setdefault(i, []).append(inp[0][0])
        )
        for i, m in enumerate(mods)
    ]
    try:
        gen = greedy_generate(model, prompt, n_new)
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        attn = model(input_ids=torch.tensor([prompt]), output_attentions=True).attentions
    n_heads, head_dim = model.config.num_attention_heads, mods[0].head_dim
    outs = [
        torch.cat(caught[i]).reshape(len(gen.fed_ids), n_heads, head_dim).numpy()
        for i in range(len(mods))
    ]
    return outs, [a[0].numpy() for a in attn], gen


def _allowed(positions, kv_len, window=None):
    """(n, kv_len) causal mask, limited to (t - window, t] for a sliding layer."""
    pos = np.asarray(positions)[:, None]
    keys = np.arange(kv_len)[None, :]
    return (keys <= pos) & ((keys > pos - window) if window is not None else True)


def _recompute(q, k, v, positions, scaling, window=None):
    """float64 causal attention from recorded arrays: q (H, n, D), k/v (H_kv, T, D)."""
    group = q.shape[0] // k.shape[0]
    kk = np.repeat(k.astype(np.float64), group, axis=0)
    vv = np.repeat(v.astype(np.float64), group, axis=0)
    logits = np.einsum("hqd,hkd->hqk", q.astype(np.float64), kk) * scaling
    causal = _allowed(positions, k.shape[1], window)
    logits = np.where(causal[None], logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("hqk,hkd->hqd", w, vv)


def _hf_eager_isolated(model, layer, rec, window=None):
    """HF's own eager attention of the model family applied to the recorded Q/K/V of a layer."""
    eager_fn = importlib.import_module(type(model).__module__).eager_attention_forward
    module = attention_modules(model)[layer]
    q, k, v = (torch.from_numpy(a)[None] for a in (rec.queries, rec.keys, rec.values))
    allowed = _allowed(rec.positions, k.shape[2], window)
    mask = torch.zeros(allowed.shape).masked_fill(torch.from_numpy(~allowed), float("-inf"))
    out, _ = eager_fn(module, q, k, v, mask[None, None], scaling=module.scaling)
    return out[0].transpose(0, 1).numpy()


def check_against_hf(model, prompt, gen, layers, n_new, e2e_tol):
    """The three comparisons of the issue, for every layer.

    1. HF eager attention on the recorded Q/K/V (same inputs): ``atol`` 1e-5.
    2. float64 numpy softmax attention recomputed from the recorded Q/K/V: 1e-5 (plus 1e-6
       relative, for layers whose outputs reach ~10).
    3. HF eager run end to end through the same greedy loop (o_proj inputs): ``e2e_tol`` times
       the layer's output scale, because fp32 round-off of two kernels compounds over layers.
    Also H2O against the sum of eager's own prefill attention weights (end to end as well, so
    relative to the sum's size).
    """
    ref_out, ref_attn, ref_gen = _eager_reference(model, prompt, n_new)
    assert ref_gen.generated_ids == gen.generated_ids
    plen = len(prompt)
    scaling = attention_modules(model)[0].scaling
    rule = attention_variants(model)["layer_attention"]
    for layer, rec in enumerate(layers):
        window = layer_window(rule, layer)  # Mistral's real window (8 < the prompt)
        np.testing.assert_allclose(rec.outputs, _hf_eager_isolated(model, layer, rec, window),
                                   atol=TOL, rtol=0,
                                   err_msg=f"layer {layer}: HF eager on recorded Q/K/V")
        again = _recompute(rec.queries, rec.keys, rec.values, rec.positions, scaling, window)
        np.testing.assert_allclose(rec.outputs, again, atol=TOL, rtol=1e-6,
                                   err_msg=f"layer {layer}: recomputed from recorded Q/K/V")
        eager = ref_out[layer][rec.positions].transpose(1, 0, 2)
        scale = max(1.0, float(np.abs(eager).max()))
        np.testing.assert_allclose(rec.outputs, eager, atol=e2e_tol * scale, rtol=0,
                                   err_msg=f"layer {layer}: HF eager end to end")
        np.testing.assert_allclose(rec.h2o[:, :plen], ref_attn[layer].sum(axis=1), atol=TOL,
                                   rtol=e2e_tol, err_msg=f"layer {layer}: H2O vs eager weights")
        assert np.all(rec.h2o[:, plen:] == 0)


@pytest.mark.parametrize("arch", ARCHS)
def test_recorded_outputs_match_eager_and_recomputation(arch):
    model = tiny_model(arch, seed=3)
    prompt = _prompt()
    windows = list(range(20, 28)) + list(range(PROMPT_LEN - 8, PROMPT_LEN))
    gen, layers = _capture(model, prompt, record_positions=windows, record_from=PROMPT_LEN)
    n_pos = len(gen.fed_ids)
    assert n_pos == PROMPT_LEN + len(gen.generated_ids) - 1
    expected_pos = sorted(set(windows) | set(range(PROMPT_LEN, n_pos)))
    assert len(layers) == model.config.num_hidden_layers
    for rec in layers:
        assert rec.positions.tolist() == expected_pos
        assert rec.keys.shape == (2, n_pos, 16) and rec.values.shape == (2, n_pos, 16)
        assert rec.queries.shape == (4, len(expected_pos), 16) == rec.outputs.shape
    # Two layers of a tiny model: even end to end stays within 1e-5 absolute.
    check_against_hf(model, prompt, gen, layers, N_NEW, e2e_tol=TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_does_not_change_generation(arch):
    model = tiny_model(arch, seed=5)
    prompt = _prompt(seed=2)
    gen, _ = _capture(model, prompt, record_all=True)
    for impl in ("sdpa", "eager"):
        set_attention(model, impl)
        plain = greedy_generate(model, prompt, N_NEW)
        assert plain.generated_ids == gen.generated_ids
        np.testing.assert_allclose(plain.logprobs, gen.logprobs, rtol=0, atol=1e-4)


def test_h2o_brute_force_and_chunking():
    """All-position capture with tiny chunks equals a float64 brute force over recorded Q/K."""
    model = tiny_model("qwen3", seed=7)
    prompt = _prompt(seed=4, n=50)
    gen, layers = _capture(model, prompt, record_all=True, h2o_chunk=7, prefill_chunk=13)
    _, one_shot = _capture(model, prompt, record_all=True)
    scaling = attention_modules(model)[0].scaling
    for rec, ref in zip(layers, one_shot, strict=True):
        assert rec.positions.tolist() == list(range(len(gen.fed_ids)))
        q = rec.queries[:, :50].astype(np.float64)
        k = np.repeat(rec.keys.astype(np.float64), 2, axis=0)
        logits = np.einsum("hqd,hkd->hqk", q, k) * scaling
        logits = np.where(np.tril(np.ones((50, k.shape[1]), bool)), logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        brute = (w / w.sum(-1, keepdims=True)).sum(axis=1)
        np.testing.assert_allclose(rec.h2o, brute, rtol=0, atol=TOL)
        np.testing.assert_allclose(rec.h2o, ref.h2o, rtol=0, atol=TOL)
        np.testing.assert_allclose(rec.outputs, ref.outputs, rtol=0, atol=TOL)
        np.testing.assert_allclose(rec.keys, ref.keys, rtol=0, atol=TOL)


def test_bias_hook_masks_keys_per_kv_head():
    """The enforcement extension point: -inf drops keys, a finite bias offsets logits."""
    model = tiny_model("llama", seed=9)
    prompt = _prompt(seed=6, n=30)
    evicted = [3, 4, 10]
    offset = torch.zeros(30)
    offset[12:20] = -np.log(0.25)

    def bias_fn(layer, positions, kv_len):
        assert kv_len == 30  # one generated token: prefill only
        b = torch.zeros(2, positions.numel(), kv_len)
        b[0, :, evicted] = float("-inf")  # KV head 0 evicts
        b[1] = offset[None, :]  # KV head 1 down-weights a span, as -log(pi) would
        return b if layer == 0 else None

    state = CaptureState(30, record_all=True, bias_fn=bias_fn)
    with recording(model, state):
        greedy_generate(model, prompt, 1, state=state)
    rec = state.finalize()[0]
    scaling = attention_modules(model)[0].scaling
    q, k, v = (a.astype(np.float64) for a in (rec.queries, rec.keys, rec.values))
    for head in range(4):
        kv = head // 2
        logits = q[head] @ k[kv].T * scaling
        if kv == 0:
            logits[:, evicted] = -np.inf
        else:
            logits += offset.numpy()[None, :]
        logits = np.where(np.tril(np.ones((30, 30), bool)), logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        expected = (w / w.sum(-1, keepdims=True)) @ v[kv]
        np.testing.assert_allclose(rec.outputs[head], expected, rtol=0, atol=TOL)


def test_state_is_per_run_and_requires_capture_attention():
    model = tiny_model("llama", seed=0)
    state = CaptureState(10, record_all=True)
    with recording(model, state):
        assert all(getattr(m, STATE_ATTR) is state for m in attention_modules(model))
        greedy_generate(model, _prompt(n=10), 2, state=state)
    assert not any(hasattr(m, STATE_ATTR) for m in attention_modules(model))
    # Without a state the function is plain SDPA and records nothing.
    greedy_generate(model, _prompt(n=10), 2)
    assert len(state.layers) == 2 and state.layers[0].keys.shape[1] == 11
    set_attention(model, "sdpa")
    with pytest.raises(ValueError, match="attn_implementation"):
        with recording(model, CaptureState(10)):
            pass


def test_a_cache_that_drops_positions_is_refused():
    """Capture keeps every position (a cache of full layers, the mask holding the window); a
    call whose cache lacks positions of the declared step cannot slip into a trace."""
    state = CaptureState(20, record_all=True)
    state.begin_step(12, 20)
    q, kv = torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 8, 16)  # 8 cached positions, not 20
    with pytest.raises(RuntimeError, match="full \\(non-sliding\\) cache"):
        state.record(0, q, kv, kv, torch.zeros(1, 8, 4, 16), None, 0.25)
