"""Every supported family, attention variants included, captured faithfully (issue 29).

For a tiny random-config model of each family (windows shorter than the prompt, Gemma's soft-cap
and query_pre_attn_scalar, Gemma 3's MQA, gpt-oss's sinks, Phi-3's fused QKV, MoE blocks):
the stored outputs equal Hugging Face's own eager attention outputs (the o_proj input) at every
position, under ``generate`` with the model's own (sliding) cache; the float64 reference
``tracesim.attention_rule.attention_outputs`` recomputes them from the stored Q/K/V with the
recorded rule; the store round-trips the rule; anything else is refused before a forward pass.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tracesim.capture.attention import CaptureState, attention_modules, recording
from tracesim.capture.generate import greedy_generate
from tracesim.capture.models import _TINY_ARCHS, set_attention, tiny_model
from tracesim.capture.variants import UnsupportedModel, attention_variants, check_supported
from transformers import AutoConfig

from tracesim.attention_rule import attention_outputs, layer_window

pytestmark = pytest.mark.capture

ARCHS = tuple(_TINY_ARCHS)
PROMPT_LEN, N_NEW = 20, 4


def _prompt(n: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _capture(model, prompt):
    state = CaptureState(len(prompt), record_all=True)
    with recording(model, state):
        gen = greedy_generate(model, prompt, N_NEW, state=state, prefill_chunk=7)
    return gen, state.finalize()


def _hf_generate_outputs(model, prompt):
    """o_proj inputs ``(n_fed, H, D)`` per layer under HF's own eager ``generate`` (its default
    cache: sliding layers keep only their window), and the generated ids."""
    set_attention(model, "eager")
    caught: dict[int, list[torch.Tensor]] = {}
    hooks = [m.o_proj.register_forward_hook(
        lambda mod, inp, out, i=i: caught.setdefault(i, []).append(inp[0][0]))
        for i, m in enumerate(attention_modules(model))]
    try:
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=N_NEW, do_sample=False,
                                 pad_token_id=0, eos_token_id=None, min_new_tokens=N_NEW)
    finally:
        for h in hooks:
            h.remove()
    mods = attention_modules(model)
    n_heads, head_dim = model.config.num_attention_heads, mods[0].head_dim
    outs = [torch.cat(caught[i]).reshape(-1, n_heads, head_dim).numpy()
            for i in range(len(mods))]
    return outs, ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_stored_outputs_equal_hf_eager_and_the_float64_rule(arch):
    model = tiny_model(arch, seed=3)
    prompt = _prompt()
    variants = attention_variants(model)
    gen, layers = _capture(model, prompt)
    n_fed = len(gen.fed_ids)
    ref, ref_ids = _hf_generate_outputs(model, prompt)
    assert ref_ids == gen.generated_ids
    scaling = attention_modules(model)[0].scaling
    for layer, rec in enumerate(layers):
        assert rec.positions.tolist() == list(range(n_fed))
        assert rec.keys.shape[1] == n_fed  # every position, sliding layers too
        hf = ref[layer][:n_fed].transpose(1, 0, 2)
        scale = max(1.0, float(np.abs(hf).max()))
        np.testing.assert_allclose(rec.outputs, hf, rtol=0, atol=2e-5 * scale,
                                   err_msg=f"{arch} layer {layer}: HF eager generate")
        sinks = None if variants["sinks"] is None else np.array(variants["sinks"][layer])
        again = attention_outputs(rec.queries, rec.keys, rec.values, rec.positions, scaling,
                                  window=layer_window(variants["layer_attention"], layer),
                                  softcap=variants["attn_logit_softcap"], sinks=sinks)
        np.testing.assert_allclose(rec.outputs, again, rtol=1e-6, atol=1e-5,
                                   err_msg=f"{arch} layer {layer}: float64 rule")
        # H2O: prefill queries' attention, each query spreading 1 (less its sink share).
        totals = rec.h2o.sum(axis=1)
        if sinks is None:
            np.testing.assert_allclose(totals, PROMPT_LEN, rtol=1e-5)
        else:
            assert np.all(totals < PROMPT_LEN - 1e-3) and np.all(totals > 0)


def test_the_variants_are_recorded_and_matter():
    """The rule is not vacuous: each recorded variant changes the outputs of its family."""
    cases = {"mistral": dict(window=None), "gemma2": dict(softcap=None),
             "gpt_oss": dict(sinks=None)}
    for arch, dropped in cases.items():
        model = tiny_model(arch, seed=3)
        v = attention_variants(model)
        _, layers = _capture(model, _prompt())
        rec, scaling = layers[0], attention_modules(model)[0].scaling
        rule = dict(window=layer_window(v["layer_attention"], 0), softcap=v["attn_logit_softcap"],
                    sinks=None if v["sinks"] is None else np.array(v["sinks"][0]))
        wrong = attention_outputs(rec.queries, rec.keys, rec.values, rec.positions, scaling,
                                  **{**rule, **dropped})
        assert np.abs(wrong - rec.outputs).max() > 1e-3, arch
    assert attention_variants(tiny_model("gemma3"))["layer_attention"] == [
        {"kind": "sliding", "window": 8}, {"kind": "full", "window": None}]
    assert attention_modules(tiny_model("gemma3"))[0].scaling == pytest.approx(24 ** -0.5)


def test_unsupported_architectures_and_variants_are_refused_by_name():
    with pytest.raises(UnsupportedModel, match="model_type 'falcon'"):
        check_supported(AutoConfig.for_model("falcon"))
    cfg = AutoConfig.for_model("qwen2")
    cfg.layer_types = ["chunked_attention"] * cfg.num_hidden_layers
    with pytest.raises(UnsupportedModel, match="chunked_attention"):
        check_supported(cfg)


def test_cli_refuses_an_unsupported_checkpoint_before_loading(tmp_path, capsys):
    from tracesim.app.cli import main

    ckpt = tmp_path / "ckpt"
    AutoConfig.for_model("falcon").save_pretrained(ckpt)  # a config and no weights at all
    code = main(["capture", "--model", str(ckpt), "--n", "1", "--length", "64",
                 "--out", str(tmp_path / "out"), "--quiet"])
    assert code == 2
    printed = capsys.readouterr()
    assert printed.out == ""  # refusals go to stderr
    assert "model_type 'falcon' is not supported" in printed.err
    assert "Traceback" not in printed.err
    assert not (tmp_path / "out").exists()


def test_store_round_trips_the_rule_and_validates(tmp_path):
    """A gpt-oss capture (sliding + full, sinks) into a store: model.json carries the rule,
    subsets slice it, validate passes (h2o sums below prompt_length with sinks)."""
    from tracesim.capture.models import LoadedModel, load_model, load_tokenizer
    from tracesim.capture.runner import CaptureConfig, run_capture

    from tracesim.store import open_store, validate_store

    tok = load_tokenizer()
    model = tiny_model("gpt_oss", seed=3, vocab_size=len(tok))
    loaded = LoadedModel(model, tok, "tiny-gpt-oss")
    out = tmp_path / "store"
    run_capture(loaded, ["passkey"], n=1, length=96, out=out, storage_dtype="float32",
                config=CaptureConfig(window=8, max_new_tokens=3), progress=False,
                kv_heads=[1])
    doc = json.loads((out / "model.json").read_text())
    want = attention_variants(model)
    assert doc["layer_attention"] == want["layer_attention"]
    assert doc["sinks"] == [row[2:4] for row in want["sinks"]]  # KV head 1's query heads
    store = open_store(out)
    assert store.model.sinks == doc["sinks"] and store.model.attn_logit_softcap is None
    assert validate_store(out, check_data=True) == []
    # The loader keeps Mistral's window (nothing switches it off on the way in).
    ckpt = tmp_path / "mistral"
    tiny_model("mistral", vocab_size=len(tok)).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    assert load_model(str(ckpt)).model.config.sliding_window == 8


def test_verify_compares_a_store_with_an_independent_eager_forward(tmp_path, capsys):
    """tracesim.capture.verify on a tiny Gemma 3 checkpoint: every stored output within float32
    round-off of the eager forward and of the float64 rule."""
    from tracesim.capture.models import load_tokenizer
    from tracesim.capture.runner import CaptureConfig, run_capture
    from tracesim.capture.verify import main as verify_main
    from tracesim.capture.verify import verify_store

    tok = load_tokenizer()
    ckpt = tmp_path / "tiny-gemma3"
    tiny_model("gemma3", seed=3, vocab_size=len(tok)).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    out = tmp_path / "store"
    run_capture(str(ckpt), ["passkey"], n=1, length=96, out=out, storage_dtype="float32",
                config=CaptureConfig(window=8, max_new_tokens=3), progress=False)
    rows = verify_store(str(out), str(ckpt))
    assert [r["window"] for r in rows] == [8, None]
    for r in rows:
        assert r["eager_err"] <= 1e-4 * max(1.0, r["scale"]) and r["rule_err"] <= 1e-4, r
    assert verify_main([str(out), "--model", str(ckpt)]) == 0
    assert "largest |stored - eager|" in capsys.readouterr().out
