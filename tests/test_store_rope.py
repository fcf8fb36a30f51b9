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
    x = make_score("ExpectedAttentionPress").scores(trace, 0, trace.prompt_length)
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
    from capture.models import rope_info

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
