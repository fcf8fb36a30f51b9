"""Budget allocation (uniform, Ada-KV, PyramidKV), schedules, and realized memory in replay."""

from __future__ import annotations

import numpy as np
import pytest

from tests.replay_fixtures import synthetic_trace
from tracesim.budgets import Budget, adakv_allocation, pyramid_allocation
from tracesim.kernels import replay as K
from tracesim.policies import make_policy
from tracesim.replay import replay_layer
from tracesim.schedules import Schedule, event_of_queries, nested_inclusion


def test_budget_validation_and_tokens():
    assert Budget(0.25).tokens(100) == 25
    assert Budget(0.001).tokens(100) == 1
    assert Budget(64, unit="tokens").tokens(40) == 40
    assert Budget(0.25, allocator="adakv").label() == "adakv(alpha=0.2):0.25"
    for bad in (dict(value=0.0), dict(value=1.5), dict(value=2.5, unit="tokens"),
                dict(value=0.2, unit="bytes"), dict(value=0.2, allocator="x"),
                dict(value=0.2, alpha=2.0), dict(value=0.2, beta=0.5)):
        with pytest.raises(ValueError):
            Budget(**bad)


def test_pyramid_schedule_is_linear_and_keeps_the_total():
    alloc = pyramid_allocation(100, 30, beta=20)
    assert alloc.sum() == 3000
    assert (np.diff(alloc) <= 0).all()
    assert alloc[0] == pytest.approx(200 - 5, abs=1) and alloc[-1] == pytest.approx(5, abs=1)
    assert Budget(0.5, allocator="pyramidkv").layer_tail_budget(100, 0, 30) == alloc[0]
    assert pyramid_allocation(7, 1).tolist() == [7]


def test_adakv_floor_and_global_topk():
    rng = np.random.default_rng(0)
    flat = np.ones(200)
    peaked = np.r_[np.full(20, 50.0), np.full(180, 0.01)]
    alloc = adakv_allocation([flat, peaked, rng.random(200)], 40, alpha=0.2)
    assert alloc.sum() == 120
    assert (alloc >= 8).all()
    assert alloc[1] >= 20  # the peaked head wins its 20 heavy tokens
    assert alloc[1] > alloc[0]
    # Small tails cap the allocation.
    assert adakv_allocation([np.ones(5), np.ones(100)], 10).tolist()[0] <= 5


def test_schedule_events_and_running_minimum():
    s = Schedule("decode", 4)
    t = s.event_times(80, 80, 95)
    assert t.tolist() == [80, 84, 88, 92]
    assert Schedule().event_times(70, 80, 95).tolist() == [70]
    assert event_of_queries(t, np.array([10, 80, 83, 84, 95])).tolist() == [0, 0, 0, 1, 3]
    raw = np.array([[1.0, 0.5, 0.2], [0.9, 0.6, 0.1], [1.0, 0.3, 1.0]])
    np.testing.assert_array_equal(nested_inclusion(raw),
                                  [[1.0, 0.5, 0.2], [0.9, 0.5, 0.1], [0.9, 0.3, 0.1]])
    with pytest.raises(ValueError):
        Schedule("sometimes")
    with pytest.raises(ValueError):
        Schedule("decode", 0)


def test_realized_memory_matches_the_nominal_budget():
    trace = synthetic_trace(4)
    sp = {"window": 8}
    pols = [make_policy("snapkv", "poisson", 0.4, score_params=sp),
            make_policy("snapkv", "topk", 0.4, score_params=sp),
            make_policy("h2o", "poisson", Budget(0.4, allocator="adakv"), score_params=sp),
            make_policy("h2o", "poisson", Budget(0.4, allocator="pyramidkv"), score_params=sp)]
    res = replay_layer(trace, pols, np.arange(64), n_layers=3)
    B = round(0.4 * trace.prompt_length)
    tabs = res.tables
    for c in range(3):
        slot = tabs.it_slot[np.flatnonzero(tabs.it_cfg == c)[0]]
        bud = tabs.budget_tokens[tabs.slot_ev[slot]]
        assert bud.sum() == trace.n_kv_heads * B, pols[c].id
        rows = res.out[tabs.it_cfg == c]
        # Expected memory (sum of pi) is exactly the allocated budget; realized is close.
        np.testing.assert_allclose(rows[:, 0, 0, K.F_EXPECTED], bud[0])
        assert abs(rows[:, 0, 0, K.F_KEPT].mean() - bud[0]) < 0.1 * B
    # PyramidKV on layer 0 of 3 keeps more than the nominal budget.
    slot = tabs.it_slot[np.flatnonzero(tabs.it_cfg == 3)[0]]
    assert tabs.budget_tokens[tabs.slot_ev[slot]][0] > B
