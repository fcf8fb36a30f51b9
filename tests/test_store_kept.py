"""``model.json`` field ``kept``: a store of a subset of layers / heads, validated and replayed."""

from __future__ import annotations

import json

import pytest

from tests.sweep_fixtures import build_sweep_store
from tracesim.policies import make_policy
from tracesim.replay import replay
from tracesim.store import ModelMeta, StoreError, TraceWriter, open_store, validate_store
from tracesim.store.format import kept_entry


def test_kept_entry_round_trip_and_validation(tmp_path):
    store = build_sweep_store(tmp_path / "s", n_seqs=1, n_layers=2)
    doc = json.loads((store / "model.json").read_text())
    assert "kept" not in doc and open_store(store).kept["layers"] == [0, 1]
    assert not open_store(store).is_subset
    # Describe the 2-layer, 2-KV-head store as layers 3 and 7, KV heads 0 and 2 of a bigger model.
    good = kept_entry([3, 7], [0, 2], 12, 6, 3)
    assert good["heads"] == [0, 1, 4, 5]
    (store / "model.json").write_text(json.dumps({**doc, "kept": good}))
    assert validate_store(store, check_data=False) == []
    s = open_store(store)
    assert s.kept["layers"] == [3, 7] and s.is_subset
    table = replay(s, [make_policy("keydiff", "poisson", 0.5)], seeds=2, progress=False)
    assert set(table.column("layer").to_pylist()) == {0, 1}
    bad = {**good, "layers": [7, 3]}
    (store / "model.json").write_text(json.dumps({**doc, "kept": bad}))
    problems = validate_store(store, check_data=False)
    assert any("field 'kept'.layers is [7, 3]" in p for p in problems), problems
    bad = {**good, "heads": [0, 1, 2, 3]}
    (store / "model.json").write_text(json.dumps({**doc, "kept": bad}))
    assert any("kept'.heads" in p for p in validate_store(store, check_data=False))


def test_writer_refuses_another_subset_on_resume(tmp_path):
    m = ModelMeta(model_id="m", architecture="LlamaForCausalLM", n_layers=1, n_heads=2,
                  n_kv_heads=1, head_dim=4, hidden_size=8, scaling=0.5, dtype="float32")
    with TraceWriter(tmp_path / "s", m, kept=kept_entry([2], [1], 4, 4, 2)):
        pass
    with pytest.raises(StoreError, match="field 'kept'"):
        TraceWriter(tmp_path / "s", m, kept=kept_entry([3], [1], 4, 4, 2))
    with pytest.raises(StoreError, match="kept'.layers"):
        TraceWriter(tmp_path / "t", m, kept=kept_entry([2, 3], [1], 4, 4, 2))
