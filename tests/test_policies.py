"""Scores, the take-all stratum, policy configs (validation, ids, rows) and score × design."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from tests.replay_fixtures import synthetic_trace
from tracesim.budgets import Budget
from tracesim.designs import DESIGNS, make_design
from tracesim.policies import (
    POLICY_COLUMNS,
    SCORES,
    Policy,
    make_policy,
    make_score,
    policy_grid,
    take_all_mask,
)
from tracesim.policies.snapkv import pool1d
from tracesim.replay.head_rows import _top_later, head_inclusion


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(11)


@pytest.mark.parametrize("name", sorted(SCORES))
def test_every_score_is_nonnegative_and_works_with_every_design(trace, name):
    # The synthetic trace records observation windows of 8 queries (as a capture with w = 8).
    score = make_score(name, **({"window": 8} if name in ("snapkv", "SnapKVPress") else
                                {"all_positions": False} if name == "ExpectedAttentionPress"
                                else {}))
    if name == "ExpectedAttentionPress":  # needs the store's RoPE settings
        trace = dataclasses.replace(trace, rope={"rope_theta": 1e4, "rope_scaling": {
            "rope_type": "default"}}, _attention_cache={})
    end = trace.prompt_length
    seed = 3 if score.seed_dependent else None
    x = score.scores(trace, 1, end, seed)
    assert x.shape == (end,) and np.isfinite(x).all() and (x >= 0).all()
    take = score.take_all(trace, 1, end)
    n_tail = int((~take).sum())
    for dname in DESIGNS:
        design = make_design(dname)
        budget = 10
        pi = head_inclusion(x, take, design, budget, score.top_fraction)
        assert pi.shape == (end,) and ((pi >= 0) & (pi <= 1)).all()
        assert (pi[take] == 1).all()
        assert pi[~take].sum() == pytest.approx(min(budget, n_tail), abs=1e-9), dname
        if not design.randomized:
            assert set(np.unique(pi)) <= {0.0, 1.0}


def test_snapkv_matches_an_independent_computation(trace):
    score = make_score("snapkv", window=6, kernel=3, pooling="avg")
    end = trace.prompt_length
    idx = [i for i, r in enumerate(trace.query_roles) if r == "question_window"][-6:]
    acc = np.zeros(end)
    for h in trace.group(0):
        for i in idx:
            t = trace.query_positions[i]
            s = trace.keys[0, :t + 1] @ trace.queries[h, i] * trace.scale
            w = np.exp(s - s.max())
            acc[:t + 1] += (w / w.sum())[:end]
    acc /= len(trace.group(0)) * len(idx)
    pooled = np.array([acc[max(0, p - 1):p + 2].sum() / 3 for p in range(end)])
    np.testing.assert_allclose(score.scores(trace, 0, end), pooled, rtol=1e-12)
    agnostic = make_score("snapkv", question_aware=False)
    assert agnostic.compress_end(trace) == trace.question_start
    assert score.compress_end(trace) == trace.prompt_length


def test_pool1d_max_matches_brute_force():
    x = np.random.default_rng(0).random(17)
    ref = np.array([x[max(0, i - 2):i + 3].max() for i in range(17)])
    np.testing.assert_array_equal(pool1d(x, 5, "max"), ref)
    np.testing.assert_array_equal(pool1d(x, 1, "avg"), x)


def test_top_h_takes_the_highest_scores_and_the_later_of_equal_ones():
    """The top-h share of the tail budget: the set a stable sort of the reversed scores takes."""
    rng = np.random.default_rng(4)
    for trial in range(300):
        x = rng.integers(0, 4, 40).astype(float) if trial % 2 else rng.random(40)
        h = int(rng.integers(1, 40))
        ref = x.size - 1 - np.argsort(-x[::-1], kind="stable")[:h]
        assert sorted(_top_later(x, h).tolist()) == sorted(ref.tolist())


def test_streaming_topk_keeps_sinks_and_most_recent(trace):
    score = make_score("streaming")
    end = 50
    pi = head_inclusion(score.scores(trace, 0, end), score.take_all(trace, 0, end),
                        make_design("topk"), 10)
    kept = np.flatnonzero(pi == 1)
    np.testing.assert_array_equal(kept, np.r_[0:4, 40:50])


def test_h2o_sums_the_group_and_normalises(trace):
    end = trace.prompt_length
    plain = make_score("h2o").scores(trace, 1, end)
    ref = trace.h2o[list(trace.group(1)), :end].mean(axis=0)
    np.testing.assert_allclose(plain, ref, rtol=1e-12)
    norm = make_score("h2o", normalize=True).scores(trace, 1, end)
    np.testing.assert_allclose(norm, ref / (end - np.arange(end)), rtol=1e-12)


def test_random_scores_depend_on_seed_only(trace):
    for name in ("random", "keyformer"):
        score = make_score(name)
        assert score.seed_dependent
        a, b = score.scores(trace, 0, 40, 1), score.scores(trace, 0, 40, 1)
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, score.scores(trace, 0, 40, 2))


def test_vnorm_protects_largest_values_and_knorm_prefers_small_keys(trace):
    score = make_score("vnorm", window=0, sinks=0)
    end = trace.prompt_length
    x = score.scores(trace, 0, end)
    pi = head_inclusion(x, score.take_all(trace, 0, end), make_design("bernoulli"), 20,
                        score.top_fraction)
    top10 = np.argsort(-x)[:10]
    assert (pi[top10] == 1).all() and pi.sum() == pytest.approx(20)
    k = make_score("knorm").scores(trace, 0, end)
    norms = np.linalg.norm(trace.keys[0, :end], axis=1)
    assert np.argmax(k) == np.argmin(norms) and np.argmin(k) == np.argmax(norms)


def test_take_all_mask():
    m = take_all_mask(10, 2, 3)
    np.testing.assert_array_equal(np.flatnonzero(m), [0, 1, 7, 8, 9])
    assert take_all_mask(3, 4, 4).all()


@pytest.mark.parametrize("bad", [
    lambda: make_score("snapkv", kernel=4),
    lambda: make_score("snapkv", pooling="median"),
    lambda: make_score("h2o", window=-1),
    lambda: make_score("streaming", sinks=1.5),
    lambda: make_score("vnorm", top_fraction=1.5),
    lambda: make_score("knorm", temperature=-1.0),
    lambda: make_score("nope"),
    lambda: make_score("h2o", bogus=1),
    lambda: make_policy("snapkv", "fixed", 0.25, schedule="decode:4"),
    lambda: make_policy("snapkv", "poisson", 0.25, correction="magic"),
    lambda: Policy(score=make_score("h2o"), design=None, budget=Budget(0.2)),
    lambda: make_policy("h2o", "nope"),
])
def test_invalid_configs_raise(bad):
    with pytest.raises(ValueError):
        bad()


def test_policy_ids_rows_and_round_trip():
    p = make_policy("snapkv", "poisson", 0.25, design_params={"mixture": 0.1})
    q = make_policy("snapkv", "poisson", 0.25, design_params={"mixture": 0.2})
    assert p.id != q.id and p.id == make_policy("snapkv", "poisson", 0.25,
                                                 design_params={"mixture": 0.1}).id
    row = p.row()
    assert tuple(row) == POLICY_COLUMNS and row["certified"] and row["mixture"] == 0.1
    assert Policy.from_dict(json.loads(p.to_json())) == p
    assert make_policy("full", "poisson", 0.1).id == "full"
    assert make_policy("snapkv", "topk").correction == "none"
    assert make_policy("random", "bernoulli").correction == "none"
    assert make_policy("keyformer", "topk").correction == "none"
    assert not make_policy("keyformer", "topk").certified
    assert make_policy("h2o", "bernoulli").certified
    assert make_policy("snapkv", "poisson", 512).budget == Budget(512, unit="tokens")
    grid = policy_grid(["snapkv", "full"], ["topk", "poisson"], [0.1, 0.5])
    assert len(grid) == 5 and len({g.id for g in grid}) == 5


def test_snapkv_alias_on_a_short_capture_names_the_window_to_capture_with(trace):
    # SnapKVPress reads 64 window queries; the fixture stores 8: the message says --window 64.
    with pytest.raises(ValueError, match="tracesim capture --window 64"):
        make_score("SnapKVPress").scores(trace, 1, trace.prompt_length)
