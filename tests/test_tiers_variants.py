"""Tiers on sliding-window, soft-capped and sink layers: the compiled simulator against its
numpy reference; the lower tiers of a sliding layer hold only the pages its window touches;
the error before fetching is the Hájek estimate of the layer's own rule, recomputed."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_tiers_kernel import BUDGETS, SCHEDULERS, _assert_same, _policy
from tracesim.estimators import hajek_attention
from tracesim.replay import load_layer
from tracesim.replay.kept import event_inclusion
from tracesim.store import open_store
from tracesim.synth import SynthConfig, write_synthetic_store
from tracesim.tiers import MemoryModel, simulate_layer
from tracesim.tiers.reference import simulate_layer_reference

SMALL = dict(positions=120, layers=2, decode=8, window=8, question=8, h2o_queries=16,
             dtype="float32", o_proj=False)
WINDOW, PAGE = 40, 4


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiers-variants") / "store"
    write_synthetic_store(path, SynthConfig(**SMALL, sliding_window=WINDOW, full_every=2,
                                            softcap=4.0, sinks=True))
    return open_store(path)


def _layer(store, layer):
    return load_layer(store, next(iter(store)), layer)


@pytest.mark.parametrize("layer", [0, 1])
def test_kernel_matches_reference_on_variant_layers(store, layer):
    trace = _layer(store, layer)
    assert (trace.window is not None) == (layer == 0) and trace.sinks is not None
    args = (trace, _policy(), np.arange(2), 2, MemoryModel(page=PAGE), SCHEDULERS, BUDGETS)
    got = simulate_layer(*args)
    _assert_same(got, simulate_layer_reference(*args))
    # budget 1 fetches every page the layer holds: the layer's exact output
    full = got["fetch_budget"] == 1.0
    fetching = full & (got["scheduler"] != "none")
    assert np.abs(got["err2_after"][fetching]).max() <= 1e-20
    assert (got["err2_before"][full] > 0).any()


def test_sliding_layer_holds_only_its_window(store):
    """Evicted bytes per step are those of the evicted tokens in the pages the window touches
    (loop over positions); fetched bytes never exceed them; the estimate before fetching is
    hajek_attention's with the window, the cap and the sink."""
    trace = _layer(store, 0)
    policy = _policy()
    memory = MemoryModel(page=PAGE)
    got = simulate_layer(trace, policy, np.array([0]), 2, memory, ("oracle",), BUDGETS)
    pi, kept = event_inclusion(trace, policy, 0, 2)
    tb = memory.token_bytes(trace.keys.shape[2])
    rows = got["fetch_budget"] == 1.0
    qidx = trace.role_indices("decode")
    whole = 0
    for r in np.flatnonzero(rows):
        t, h = int(got["query_position"][r]), int(got["head"][r])
        g = h // trace.group_size
        lo = t - WINDOW + 1
        held_pages = {p // PAGE for p in range(lo, t + 1)}
        want = sum(tb for p in range(t + 1) if not kept[g, p] and p // PAGE in held_pages)
        whole += sum(tb for p in range(t + 1) if not kept[g, p])
        assert got["evicted_bytes"][r] == want
        assert got["kv_bytes_moved"][r] == want
        qi = int(qidx[list(trace.query_positions[qidx]).index(t)])
        est = hajek_attention(trace.queries[h, qi], trace.keys[g, :t + 1],
                              trace.values[g, :t + 1], np.where(kept[g], pi[g], 1.0)[:t + 1],
                              kept[g, :t + 1], scale=trace.scale, query_positions=[t],
                              window=WINDOW, softcap=trace.softcap, sink=trace.sink(h))
        truth = trace.outputs[h, qi]
        np.testing.assert_allclose(got["err2_before"][r], ((est.estimate - truth) ** 2).sum(),
                                   rtol=1e-6)
    # not vacuous: the window leaves evicted pages of the prompt out of the lower tiers
    assert got["evicted_bytes"][rows].sum() < whole
