"""model.json's attention-variant fields (docs/trace-format.md, "Attention variants"): checked,
omitted when unset (older stores read unchanged), and the float64 rule's edge cases."""

from __future__ import annotations

import numpy as np
import pytest

from tracesim.attention_rule import attention_outputs, population_start
from tracesim.store import ModelMeta
from tracesim.store.format import StoreError

BASE = dict(model_id="m", architecture="X", n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4,
            hidden_size=8, scaling=0.5, dtype="float32")


def test_absent_fields_mean_full_plain_attention_and_are_not_written():
    meta = ModelMeta(**BASE)
    assert meta.layer_attention is None and meta.attn_logit_softcap is None and meta.sinks is None
    assert "layer_attention" not in meta.to_dict() and "sinks" not in meta.to_dict()
    assert ModelMeta.from_dict(meta.to_dict()) == meta


def test_fields_round_trip_and_bad_values_name_the_field():
    la = [{"kind": "sliding", "window": 3}, {"kind": "full", "window": None}]
    meta = ModelMeta(**BASE, layer_attention=la, attn_logit_softcap=30, sinks=[[0.5, -1], [0, 2]])
    again = ModelMeta.from_dict(meta.to_dict())
    assert again == meta and again.attn_logit_softcap == 30.0 and again.sinks[0] == [0.5, -1.0]
    bad = [("layer_attention", la[:1], "n_layers = 2"),
           ("layer_attention", [{"kind": "sliding", "window": 0}, la[1]], r"layer_attention'\[0\]"),
           ("layer_attention", [{"kind": "full", "window": 4}, la[1]], r"layer_attention'\[0\]"),
           ("layer_attention", [{"kind": "chunked", "window": 4}, la[1]], r"\[0\]"),
           ("attn_logit_softcap", -1.0, "attn_logit_softcap"),
           ("attn_logit_softcap", float("nan"), "attn_logit_softcap"),
           ("sinks", [[0.0, 1.0]], "n_layers = 2 lists of n_heads = 2"),
           ("sinks", [[0.0, float("inf")], [0.0, 0.0]], "sinks")]
    for name, value, match in bad:
        with pytest.raises(StoreError, match=match):
            ModelMeta.from_dict({**BASE, name: value}, label="model.json")


def test_rule_edge_cases():
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(2, 3, 4)), rng.normal(size=(1, 6, 4)), rng.normal(size=(1, 6, 4))
    pos = np.array([0, 3, 5])
    assert population_start(5, 2) == 4 and population_start(1, 4) == 0
    assert population_start(pos, None).tolist() == [0, 0, 0]
    # window 1: each query sees only itself
    out = attention_outputs(q, k, v, pos, 0.5, window=1)
    np.testing.assert_allclose(out[1], v[0, pos])
    # a huge sink takes (almost) all the mass; a window >= t + 1 is full attention
    assert np.abs(attention_outputs(q, k, v, pos, 0.5, sinks=np.array([60.0, 60.0]))).max() < 1e-20
    np.testing.assert_allclose(attention_outputs(q, k, v, pos, 0.5, window=6),
                               attention_outputs(q, k, v, pos, 0.5))
    # a soft-cap far above the logits changes nothing; a small one flattens attention
    np.testing.assert_allclose(attention_outputs(q, k, v, pos, 0.5, softcap=1e6),
                               attention_outputs(q, k, v, pos, 0.5), atol=1e-9)
    flat = attention_outputs(q, k, v, pos, 0.5, softcap=1e-9)
    np.testing.assert_allclose(flat[0, 2], v[0, :6].mean(axis=0), atol=1e-6)
