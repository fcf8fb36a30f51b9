"""Synthetic stores with sliding-window layers, a soft-cap and sinks: the fields reach
model.json, the store reads them per layer, the stored outputs are the variant's attention,
old stores read as full and plain, and the peers run on them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tracesim.app.cli import main
from tracesim.replay import load_layer
from tracesim.store import StoreError, open_store
from tracesim.synth.store import SynthConfig, write_synthetic_store

SMALL = dict(positions=120, layers=2, decode=8, window=8, question=8, h2o_queries=16,
             dtype="float32", o_proj=False)


@pytest.fixture(scope="module")
def variant_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("variants") / "store"
    cfg = SynthConfig(**SMALL, sliding_window=20, full_every=2, softcap=4.0, sinks=True)
    write_synthetic_store(path, cfg)
    return path


def test_fields_are_recorded_and_read_per_layer(variant_store):
    doc = json.loads((variant_store / "model.json").read_text())
    assert doc["layer_attention"] == [{"kind": "sliding", "window": 20},
                                      {"kind": "full", "window": None}]
    assert doc["attn_logit_softcap"] == 4.0 and len(doc["sinks"]) == 2
    store = open_store(variant_store)
    a0, a1 = store.layer_attention(0), store.layer_attention(1)
    assert (a0.kind, a0.window, a1.kind, a1.window) == ("sliding", 20, "full", None)
    assert a0.softcap == 4.0 and a0.sinks.shape == (store.model.n_heads,)


def test_stored_outputs_are_the_variant_attention(variant_store):
    """The LayerTrace truth (window, cap, sink) reproduces the synth's blocked computation;
    the same rows computed as a plain layer do not."""
    store = open_store(variant_store)
    seq = next(iter(store))
    for layer in (0, 1):
        trace = load_layer(store, seq, layer)
        qi = trace.role_indices("decode")
        for h in (0, trace.n_heads - 1):
            rows = np.array(trace._attention_rows(h, qi))
            got = rows @ trace.values[h // trace.group_size]
            np.testing.assert_allclose(got, trace.outputs[h, qi], atol=2e-6)
    plain = load_layer(store, seq, 0)
    plain.window = plain.softcap = plain.sinks = None
    rows = np.array(plain._attention_rows(0, qi))
    assert np.abs(rows @ plain.values[0] - plain.outputs[0, qi]).max() > 1e-3


def test_old_store_reads_as_full_and_plain(tmp_path):
    write_synthetic_store(tmp_path / "s", SynthConfig(**SMALL))
    store = open_store(tmp_path / "s")
    doc = json.loads((tmp_path / "s" / "model.json").read_text())
    assert not {"layer_attention", "attn_logit_softcap", "sinks"} & set(doc)
    trace = load_layer(store, next(iter(store)), 0)
    assert trace.is_plain and trace.attention_kind == "full"


@pytest.mark.parametrize("bad,field", [
    ({"layer_attention": [{"kind": "local", "window": 4}, {"kind": "full", "window": None}]},
     "layer_attention'?\\[0\\]"),
    ({"layer_attention": [{"kind": "sliding", "window": 0}, {"kind": "full", "window": None}]},
     "layer_attention'?\\[0\\]"),
    ({"attn_logit_softcap": -1.0}, "attn_logit_softcap"),
    ({"sinks": [[0.0]]}, "sinks"),
])
def test_bad_fields_name_the_field(variant_store, tmp_path, bad, field):
    import shutil

    path = tmp_path / "bad"
    shutil.copytree(variant_store, path)
    doc = json.loads((path / "model.json").read_text())
    doc.update(bad)
    (path / "model.json").write_text(json.dumps(doc))
    with pytest.raises(StoreError, match=field):
        open_store(path).layer_attention(0)


def test_peers_run_on_variant_layers(variant_store, tmp_path, capsys):
    """Peers model windows, soft-caps and sinks (tests/test_peers_variants.py): the CLI runs."""
    rc = main(["peers", str(variant_store), "--peer", "quest", "--out", str(tmp_path / "p"),
               "--quiet"])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "p" / "results" / "manifest.json").exists()
