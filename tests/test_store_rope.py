"""model.json's optional RoPE settings: older stores load, new ones round-trip, bad ones fail."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from tests.replay_fixtures import build_store
from tracesim.policies import make_score
from tracesim.replay import load_layer
from tracesim.store import ModelMeta, StoreError, TraceWriter, open_store

ROPE = {"rope_theta": 100000.0, "rope_scaling": {"rope_type": "default"}}


def _model(**kw) -> ModelMeta:
    return ModelMeta(model_id="m", architecture="LlamaForCausalLM", n_layers=2, n_heads=4,
                     n_kv_heads=2, head_dim=8, hidden_size=16, scaling=8**-0.5,
                     dtype="float32", **kw)


def test_rope_fields_are_optional_and_round_trip():
    old = _model()
    assert "rope_theta" not in old.to_dict() and "rope_scaling" not in old.to_dict()
    assert ModelMeta.from_dict(old.to_dict()) == old
    new = _model(**ROPE)
    assert ModelMeta.from_dict(json.loads(json.dumps(new.to_dict()))) == new
    assert hash(new) == hash(_model(**ROPE))
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert _model(rope_theta=5e5, rope_scaling=llama3).rope_scaling == llama3


@pytest.mark.parametrize("bad", [{"rope_theta": 0.5}, {"rope_theta": float("nan")},
                                 {"rope_theta": True}, {"rope_scaling": {"factor": 2.0}},
                                 {"rope_scaling": {"rope_type": "x", "f": [1, 2]}},
                                 {"rope_scaling": "llama3"}])
def test_bad_rope_fields_are_refused(bad):
    with pytest.raises(StoreError, match="rope_"):
        _model(**bad)


def test_old_store_loads_and_expected_attention_press_refuses(tmp_path):
    path = build_store(tmp_path / "old", n_seqs=1, n_layers=1)
    raw = json.loads((path / "model.json").read_text())
    assert "rope_theta" not in raw
    store = open_store(path)
    assert store.model.rope_theta is None
    trace = load_layer(store, next(iter(store)), 0)
    assert trace.rope is None
    with pytest.raises(ValueError, match="lacks the model's RoPE settings.*re-capture"):
        make_score("ExpectedAttentionPress").scores(trace, 0, trace.prompt_length)
    # the tracesim score reads the post-RoPE queries as they are
    assert np.isfinite(make_score("expected_attention").scores(
        trace, 0, trace.prompt_length)).all()


def test_store_with_rope_settings_reaches_the_trace(tmp_path):
    path = build_store(tmp_path / "new", n_seqs=1, n_layers=1)
    raw = json.loads((path / "model.json").read_text())
    (path / "model.json").write_text(json.dumps({**raw, **ROPE}))
    store = open_store(path)
    assert store.model.rope_theta == 1e5
    trace = load_layer(store, next(iter(store)), 0)
    assert trace.rope == ROPE
    with pytest.raises(ValueError, match="--all-positions"):
        make_score("ExpectedAttentionPress").scores(trace, 0, trace.prompt_length)
    x = make_score("ExpectedAttentionPress", all_positions=False).scores(
        trace, 0, trace.prompt_length)
    assert np.isfinite(x).all() and (x >= 0).all()


def test_resuming_an_older_store_keeps_its_model_json(tmp_path):
    path = build_store(tmp_path / "old", n_seqs=1, n_layers=2)
    before = (path / "model.json").read_bytes()
    model = open_store(path).model
    with TraceWriter(path, ModelMeta(**{**model.to_dict(), **ROPE})) as writer:
        assert writer.model.rope_theta is None
    assert (path / "model.json").read_bytes() == before
    other = {**model.to_dict(), **ROPE, "head_dim": 16}
    with pytest.raises(StoreError, match="head_dim"), TraceWriter(path, ModelMeta(**other)):
        pass


def test_capture_records_the_config_rope_settings():
    pytest.importorskip("torch")
    from tracesim.capture.models import rope_info

    cfg = SimpleNamespace(rope_theta=100000, rope_scaling=None)
    assert rope_info(SimpleNamespace(config=cfg)) == ROPE
    cfg = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_info(SimpleNamespace(config=cfg)) == {
        "rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    cfg = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert rope_info(SimpleNamespace(config=cfg)) == {
        "rope_theta": 1e4, "rope_scaling": {"rope_type": "default"}}
    assert rope_info(SimpleNamespace(config=SimpleNamespace())) == {
        "rope_theta": None, "rope_scaling": None}


def test_rope_settings_of_a_transformers_config_and_the_inverse_rotation():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import torch
    from tracesim.capture.models import rope_info
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tracesim.policies.expected_attention import rope_inv_freq, unrotate

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    for kw in ({"rope_theta": 100000.0}, {"rope_theta": 5e5, "rope_scaling": llama3}):
        cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=4096,
                                       **{k: dict(v) if isinstance(v, dict) else v
                                          for k, v in kw.items()})
        info = rope_info(SimpleNamespace(config=cfg))
        assert info["rope_theta"] == kw["rope_theta"]
        assert info["rope_scaling"] == kw.get("rope_scaling", {"rope_type": "default"})
        kind = info["rope_scaling"]["rope_type"]
        if kind == "default":
            want = 1.0 / kw["rope_theta"] ** (torch.arange(0, 16, 2).double() / 16)
        else:
            want, _ = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
        np.testing.assert_allclose(rope_inv_freq(16, info), np.asarray(want, np.float64),
                                   rtol=1e-6)
    # unrotate inverts transformers' rotation
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 5, 16))
    pos = np.array([0, 3, 17, 400, 1023])
    inv = rope_inv_freq(16, ROPE)
    ang = np.concatenate([pos[:, None] * inv, pos[:, None] * inv], axis=1)
    cos, sin = torch.from_numpy(np.cos(ang))[None], torch.from_numpy(np.sin(ang))[None]
    rot, _ = apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(q), cos, sin)
    np.testing.assert_allclose(unrotate(rot.numpy()[0, 0], pos, inv), q[0, 0], atol=1e-12)
