"""VaSE, head roles and Tangram against plain-Python loops of their rules (issue #33)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from tests.replay_fixtures import synthetic_trace
from tests.test_scores import np_attention, np_capped_pps
from tracesim.budgets import (
    Budget,
    adakv_allocation,
    role_allocation,
    tangram_allocation,
    tangram_ratios,
)
from tracesim.policies import make_policy, make_score
from tracesim.prn import STREAM_PERTURBATION, permanent_uniforms
from tracesim.replay import replay_layer

SINKS, WINDOW = 4, 8


def loop_top(keys: dict[int, float], n: int) -> set[int]:
    """The ``n`` positions with the largest key, the later position first among equal keys."""
    order = sorted(keys, key=lambda i: (keys[i], i), reverse=True)
    return set(order[:n])


def loop_h2o(trace, g: int, end: int) -> dict[int, float]:
    """H2O's one-shot score: the prefill attention each key received, mean over the group."""
    heads = list(trace.group(g))
    return {i: sum(float(trace.h2o[h, i]) for h in heads) / len(heads) for i in range(end)}


def loop_stratum(end: int) -> set[int]:
    return set(range(min(SINKS, end))) | set(range(max(0, end - WINDOW), end))


def slot_pi(res, slot: int, g: int) -> np.ndarray:
    return res.tables.pi[res.tables.slot_ev[slot], g]


# -- VaSE ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget,value_share,temperature", [(0.3, 0.05, 1.0), (0.25, 0.1, 0.5)])
def test_vase_topk_keeps_the_loop_references_tokens(budget, value_share, temperature):
    """Sinks + window + the largest-‖v‖ guard, then the top tail of log b + tau * Gumbel."""
    trace = synthetic_trace(3)
    PL, P = trace.prompt_length, trace.n_positions
    policy = make_policy("vase", "topk", budget, score_params={
        "sinks": SINKS, "window": WINDOW, "value_share": value_share,
        "temperature": temperature})
    seeds = np.array([0, 7])
    res = replay_layer(trace, [policy], seeds, n_layers=1)
    B = int(min(PL, max(1, round(budget * PL))))  # tracesim rounds a fraction to a token
    for si, seed in enumerate(seeds):
        for g in range(trace.n_kv_heads):
            take = loop_stratum(PL)
            norms = {i: math.sqrt(sum(float(x) ** 2 for x in trace.values[g, i]))
                     for i in range(PL) if i not in take}
            guard = loop_top(norms, int(round(value_share * PL)))
            take |= guard
            b = loop_h2o(trace, g, PL)
            u = permanent_uniforms(int(seed), 0, g, np.arange(PL), stream=STREAM_PERTURBATION)
            z = {i: math.log(max(b[i], 1e-300)) + temperature * -math.log(-math.log(u[i]))
                 for i in range(PL) if i not in take}
            kept = take | loop_top(z, B - len(take))
            pi = slot_pi(res, si, g)
            assert set(np.flatnonzero(pi[:PL] == 1.0)) == kept
            assert np.all((pi[:PL] == 0.0) | (pi[:PL] == 1.0))
            assert np.all(pi[PL:P] == 1.0)
            assert len(kept) == B
    assert not policy.certified and policy.needs_seeds


def test_vase_at_temperature_zero_is_a_certified_poisson_design_over_the_base_score():
    trace = synthetic_trace(4)
    PL, budget, mix = trace.prompt_length, 0.3, 0.1
    policy = make_policy("vase", "poisson", budget, score_params={
        "sinks": SINKS, "window": WINDOW, "value_share": 0.05, "temperature": 0.0},
        design_params={"mixture": mix})
    assert policy.certified and policy.correction == "hajek"
    assert not policy.score.seed_dependent
    res = replay_layer(trace, [policy], np.array([1]), n_layers=1)
    B = round(budget * PL)
    for g in range(trace.n_kv_heads):
        take = loop_stratum(PL)
        norms = {i: float(np.linalg.norm(trace.values[g, i])) for i in range(PL)
                 if i not in take}
        take |= loop_top(norms, round(0.05 * PL))
        tail = [i for i in range(PL) if i not in take]
        b = loop_h2o(trace, g, PL)
        expect = np.ones(PL)
        expect[tail] = np_capped_pps(np.array([b[i] for i in tail]), B - len(take), mix)
        np.testing.assert_allclose(slot_pi(res, 0, g)[:PL], expect, rtol=1e-10, atol=1e-12)


def test_vase_differs_from_vnorm_and_validates_its_fields():
    vase, vnorm = make_score("vase"), make_score("vnorm")
    assert vase.base == "h2o" and vnorm.top_fraction == 0.5
    for bad in ({"base": "vase"}, {"base": "random"}, {"base": "nope"},
                {"value_share": 1.0}, {"temperature": -1.0}):
        with pytest.raises(ValueError, match="VaSEScore|vase|score"):
            make_score("vase", **bad)


# -- head roles ---------------------------------------------------------------------------------
def loop_long_range_mass(trace, g: int, end: int) -> float:
    total, n = 0.0, 0
    for h in trace.group(g):
        for p in trace.query_positions:
            if p >= end:
                continue
            row = np_attention(trace, h, int(p))
            total += sum(row[i] for i in range(SINKS, int(p) + 1 - WINDOW))
            n += 1
    return total / n


def test_head_roles_keep_the_loop_references_tokens():
    """Retrieval heads: sinks + window + top tail by h2o up to the budget; streaming heads:
    sinks + window only. Roles from the prefill's long-range attention mass."""
    trace = synthetic_trace(5, n_heads=6, n_kv=3)
    PL = trace.prompt_length
    mass = [loop_long_range_mass(trace, g, PL) for g in range(trace.n_kv_heads)]
    threshold = float(np.median(mass))  # a mix of roles: the median head is retrieval
    budget = 0.5
    policy = make_policy("headroles", "topk", budget, score_params={
        "sinks": SINKS, "window": WINDOW, "threshold": threshold})
    np.testing.assert_array_equal(policy.score.retrieval_heads(trace),
                                  [m >= threshold for m in mass])
    res = replay_layer(trace, [policy], np.array([0]), n_layers=1)
    B = round(budget * PL)
    roles = []
    for g in range(trace.n_kv_heads):
        take = loop_stratum(PL)
        retrieval = mass[g] >= threshold
        roles.append(retrieval)
        b = loop_h2o(trace, g, PL)
        n = B - len(take) if retrieval else 0
        kept = take | loop_top({i: b[i] for i in range(PL) if i not in take}, n)
        assert set(np.flatnonzero(slot_pi(res, 0, g)[:PL] == 1.0)) == kept
        assert res.tables.budget_tokens[0, g] == len(kept)
    assert any(roles) and not all(roles)


def test_head_roles_with_a_streaming_tail_are_certified_per_head():
    trace = synthetic_trace(6, n_heads=6, n_kv=3)
    PL = trace.prompt_length
    mass = [loop_long_range_mass(trace, g, PL) for g in range(trace.n_kv_heads)]
    threshold = float(np.median(mass))
    policy = make_policy("headroles", "poisson", 0.5, score_params={
        "sinks": SINKS, "window": WINDOW, "threshold": threshold, "streaming_tail": 6})
    assert policy.certified
    res = replay_layer(trace, [policy], np.array([0, 1]), n_layers=1)
    for g in range(trace.n_kv_heads):
        take = loop_stratum(PL)
        tail = [i for i in range(PL) if i not in take]
        n = round(0.5 * PL) - len(take) if mass[g] >= threshold else 6
        b = loop_h2o(trace, g, PL)
        expect = np.ones(PL)
        expect[tail] = np_capped_pps(np.array([b[i] for i in tail]), n, 0.0)
        np.testing.assert_allclose(slot_pi(res, 0, g)[:PL], expect, rtol=1e-10, atol=1e-12)


def test_head_roles_from_duoattention_gates_file(tmp_path):
    """With ``gates``, the roles are the gate values thresholded (DuoAttention's deployment)."""
    trace = synthetic_trace(5, n_heads=6, n_kv=3)
    np.savez(tmp_path / "gates.npz", gates=np.array([[0.9, 0.1, 0.5]]))
    policy = make_policy("headroles", "topk", 0.5, score_params={
        "sinks": SINKS, "window": WINDOW, "threshold": 0.5,
        "gates": str(tmp_path / "gates.npz")})
    np.testing.assert_array_equal(policy.score.retrieval_heads(trace), [True, False, True])
    res = replay_layer(trace, [policy], np.array([0]), n_layers=1)
    stratum = len(loop_stratum(trace.prompt_length))
    np.testing.assert_array_equal(res.tables.budget_tokens[0],
                                  [round(0.5 * trace.prompt_length), stratum,
                                   round(0.5 * trace.prompt_length)])
    np.savez(tmp_path / "bad.npz", gates=np.array([[1.5, 0.0]]))
    with pytest.raises(ValueError, match="bad.npz: field 'gates'"):
        make_score("headroles", gates=str(tmp_path / "bad.npz"))
    np.savez(tmp_path / "nofield.npz", other=np.zeros((1, 3)))
    with pytest.raises(ValueError, match="no field 'gates'"):
        make_score("headroles", gates=str(tmp_path / "nofield.npz"))


def test_head_roles_refuse_other_allocators_and_bad_fields():
    with pytest.raises(ValueError, match="allocator is 'adakv', expected 'uniform'"):
        make_policy("headroles", "topk", Budget(0.5, allocator="adakv"))
    for bad in ({"threshold": 1.5}, {"streaming_tail": -1}, {"base": "headroles"}):
        with pytest.raises(ValueError, match="HeadRolesScore"):
            make_score("headroles", **bad)
    np.testing.assert_array_equal(
        role_allocation(np.array([True, False, True]), np.array([10, 10, 3]), 5, 1), [5, 1, 3])


# -- Tangram ------------------------------------------------------------------------------------
def test_tangram_is_static_and_differs_from_adakv():
    """Tangram fixes per-head budgets from calibration; Ada-KV re-allocates per input."""
    rng = np.random.default_rng(0)
    T, n_kv, N = 20, 4, 60
    skew = np.array([0.3, 1.0, 3.0, 0.6])  # heads of different concentration

    def sample():
        return [rng.dirichlet(np.full(N, s)) for s in skew]

    calib = np.array([adakv_allocation(sample(), T) for _ in range(50)])
    ratios = tangram_ratios(calib)
    assert ratios.mean() == pytest.approx(1.0)
    # Loop reference: each sample's share relative to its mean head, median over samples.
    rel = [[float(a) / (sum(row) / len(row)) for a in row] for row in calib.tolist()]
    med = [statistics.median(r[h] for r in rel) for h in range(n_kv)]
    np.testing.assert_allclose(ratios, [m / (sum(med) / n_kv) for m in med], rtol=1e-12)
    new_inputs = [sample() for _ in range(5)]
    tangram = [tangram_allocation(ratios, T, np.array([s.size for s in x]))
               for x in new_inputs]
    adakv = [adakv_allocation(x, T) for x in new_inputs]
    assert all(np.array_equal(t, tangram[0]) for t in tangram)  # input-invariant
    assert not all(np.array_equal(a, adakv[0]) for a in adakv)  # Ada-KV is not
    assert any(not np.array_equal(a, t) for a, t in zip(adakv, tangram, strict=True))
    assert all(int(t.sum()) == n_kv * T for t in tangram)
    # Loop reference of the rounding: floor, then +1 to the largest remainders (earlier first).
    exact = [r * n_kv * T / sum(ratios) for r in ratios]
    alloc = [math.floor(e) for e in exact]
    for i in sorted(range(n_kv), key=lambda i: (-(exact[i] - alloc[i]), i))[
            :n_kv * T - sum(alloc)]:
        alloc[i] += 1
    np.testing.assert_array_equal(tangram[0], alloc)
    with pytest.raises(ValueError, match="tangram_ratios"):
        tangram_ratios(np.array([1.0, -1.0]))


def test_tangram_score_replays_the_calibrated_static_budgets(tmp_path):
    """calibrate_tangram over a store (Ada-KV's allocations -> ratios), then replay: every
    sequence gets the same per-head budgets, ratios x T by largest remainder."""
    from tests.replay_fixtures import build_store
    from tracesim.policies.tangram import save_tangram_profile
    from tracesim.replay import load_layer
    from tracesim.replay.calibrate import calibrate_tangram
    from tracesim.store import open_store

    store = open_store(build_store(tmp_path / "store", n_seqs=2, n_layers=2))
    ratios = calibrate_tangram(store, "h2o", 0.4, sinks=SINKS, window=WINDOW)
    assert ratios.shape == (2, store.model.n_kv_heads)
    np.testing.assert_allclose(ratios.mean(axis=1), 1.0)
    save_tangram_profile(tmp_path / "profile.npz", ratios)
    policy = make_policy("tangram", "topk", 0.4, score_params={
        "base": "h2o", "sinks": SINKS, "window": WINDOW, "profile": str(tmp_path / "profile.npz")})
    for sid in store.sequence_ids:
        for layer in range(2):
            trace = load_layer(store, store[sid], layer)
            res = replay_layer(trace, [policy], np.array([0]), n_layers=2)
            PL = trace.prompt_length
            T = round(0.4 * PL) - len(loop_stratum(PL))
            want = tangram_allocation(ratios[layer], T)
            np.testing.assert_array_equal(res.tables.budget_tokens[0],
                                          len(loop_stratum(PL)) + want)
    with pytest.raises(ValueError, match="no such file"):
        make_score("tangram", profile=str(tmp_path / "missing.npz"))
    np.savez(tmp_path / "bad.npz", ratios=np.array([[1.0, -1.0]]))
    with pytest.raises(ValueError, match="bad.npz: field 'ratios'"):
        make_score("tangram", profile=str(tmp_path / "bad.npz"))


def test_vase_and_head_roles_under_decode_eviction_are_nested_and_thread_independent():
    """decode:2 events keep the nested rule (pi never rises for a token) and the results are
    the same bytes on 1 and 2 numba threads."""
    from tests.replay_fixtures import assert_same_on_one_and_two_threads

    trace = synthetic_trace(8)
    policies = [
        make_policy("vase", "poisson", 0.3, schedule="decode:2",
                    score_params={"sinks": SINKS, "window": WINDOW, "temperature": 1.0}),
        make_policy("headroles", "poisson", 0.5, schedule="decode:2",
                    score_params={"sinks": SINKS, "window": WINDOW, "threshold": 0.5,
                                  "streaming_tail": 4}),
    ]
    one, _ = assert_same_on_one_and_two_threads(trace, policies, np.array([0, 1]))
    t = one.tables
    for slot in range(t.slot_ev.size - 1):
        pis = t.pi[t.slot_ev[slot]:t.slot_ev[slot + 1]]
        assert pis.shape[0] > 1  # several events
        assert np.all(np.diff(pis, axis=0) <= 1e-15)
