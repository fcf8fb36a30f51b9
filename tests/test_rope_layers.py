"""RoPE per layer type (Gemma 3: one base on sliding layers, another on full ones) reaches
model.json as ``layer_rope``, survives a layer subset, and gives each stored layer its own."""

from __future__ import annotations

import pytest
from tracesim.capture.models import rope_info, tiny_model
from tracesim.capture.runner import subset_rope

from tracesim.store import ModelMeta, StoreError

pytestmark = pytest.mark.capture

BASE = dict(model_id="m", architecture="Gemma3ForCausalLM", n_layers=2, n_heads=4,
            n_kv_heads=1, head_dim=16, hidden_size=64, scaling=0.25, dtype="float16")


def test_gemma3_records_each_layer_types_rope():
    model = tiny_model("gemma3")
    cfg = model.config
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    info = rope_info(model)
    assert info["rope_theta"] is None and info["rope_scaling"] is None
    want = [float(cfg.rope_parameters[t]["rope_theta"]) for t in cfg.layer_types]
    assert [r["rope_theta"] for r in info["layer_rope"]] == want
    assert want[0] != want[1]                      # 10 000 local, 1 000 000 global
    meta = ModelMeta.from_dict({**BASE, **info})
    assert meta.rope(0)["rope_theta"] == want[0] and meta.rope(1)["rope_theta"] == want[1]
    assert ModelMeta.from_dict(meta.to_dict()) == meta
    # a store of layer 1 only keeps layer 1's RoPE
    sub = ModelMeta.from_dict({**BASE, "n_layers": 1, **subset_rope(info, [1])})
    assert sub.rope(0)["rope_theta"] == want[1]


def test_one_rope_models_are_unchanged():
    info = rope_info(tiny_model("llama"))
    assert "layer_rope" not in info and info["rope_theta"] > 1
    meta = ModelMeta.from_dict({**BASE, **info})
    assert "layer_rope" not in meta.to_dict()
    assert meta.rope(1) == {"rope_theta": info["rope_theta"],
                            "rope_scaling": info["rope_scaling"]}


@pytest.mark.parametrize("bad", [
    [{"rope_theta": 1e4, "rope_scaling": {"rope_type": "default"}}],             # one entry
    [{"rope_theta": 0.5, "rope_scaling": None}] * 2,                              # theta <= 1
    [{"rope_theta": 1e4}] * 2,                                                    # no scaling
])
def test_bad_layer_rope_names_the_field(bad):
    with pytest.raises(StoreError, match="layer_rope"):
        ModelMeta.from_dict({**BASE, "layer_rope": bad})
