"""The replay engine against a plain-numpy reference, and its invariances."""

from __future__ import annotations

import numpy as np
import pytest

from tests.replay_fixtures import assert_same_on_one_and_two_threads, synthetic_trace
from tests.replay_reference import reference_replay
from tracesim import output_space_certificate
from tracesim.budgets import Budget
from tracesim.kernels import replay as K
from tracesim.policies import make_policy
from tracesim.replay import ReplayOptions, replay_layer
from tracesim.replay.inclusion import seed_uniforms

SMALL = {"window": 8}


def _policies():
    sp = SMALL
    return [
        make_policy("full"),
        make_policy("snapkv", "topk", 0.3, score_params=sp),
        make_policy("snapkv", "poisson", 0.3, score_params=sp,
                    design_params={"mixture": 0.1}),
        make_policy("snapkv", "poisson", 0.3, score_params={**sp, "question_aware": False,
                                                           "pooling": "max"}),
        make_policy("h2o", "bernoulli", 0.4, score_params={**sp, "normalize": True}),
        make_policy("knorm", "fixed", 0.3, score_params=sp),
        make_policy("vnorm", "poisson", 0.4, score_params=sp),
        make_policy("streaming", "poisson", 0.3, schedule="decode:4"),
        make_policy("tova", "topk", 0.3, schedule="decode:4"),
        make_policy("h2o", "poisson", Budget(0.3, allocator="adakv"), score_params=sp,
                    design_params={"mixture": 0.2}),
        make_policy("snapkv", "poisson", Budget(0.3, allocator="pyramidkv"), score_params=sp),
        make_policy("keyformer", "topk", 0.3, score_params=sp),
        make_policy("random", "bernoulli", 0.3),
        make_policy("random", "bernoulli", 0.3, correction="hajek"),
        # per-step designs: a fresh sample from a proxy of every decode query
        make_policy("perstep", "poisson", 0.3, schedule="step", design_params={"mixture": 0.1},
                    score_params={**sp, "proxy": "exact"}),
        make_policy("perstep", "topk", 0.3, schedule="step",
                    score_params={**sp, "proxy": "quant:2"}),
        make_policy("perstep", "poisson", 0.3, schedule="step:permanent",
                    score_params={**sp, "proxy": "pages:4", "gqa": "max"}),
        make_policy("perstep", "poisson", 0.3, schedule="step",
                    score_params={**sp, "proxy": "simhash:4,16", "top_fraction": 0.0}),
        make_policy("perstep", "poisson", 0.3, schedule="step",
                    score_params={**sp, "proxy": "lowrank:4", "linearised": True}),
    ]


@pytest.fixture(scope="module")
def engine_run():
    trace = synthetic_trace(3)
    policies = _policies()
    seeds = np.array([0, 1, 2])
    res = replay_layer(trace, policies, seeds, n_layers=4,
                       options=ReplayOptions(satterthwaite=True))
    return trace, policies, seeds, res


def test_engine_matches_numpy_reference(engine_run):
    trace, policies, seeds, res = engine_run
    ref, lref = reference_replay(trace, policies, seeds, res.tables)
    out = res.out
    for f in range(K.N_FIELDS):
        a, b = out[..., f], ref[..., f]
        assert np.array_equal(np.isnan(a), np.isnan(b)), f"NaN pattern of field {f}"
        ok = ~np.isnan(a)
        np.testing.assert_allclose(a[ok], b[ok], rtol=1e-10, atol=1e-12,
                                   err_msg=f"field {f}")
    for f in range(K.N_LAYER_FIELDS):
        a, b = res.lout[..., f], lref[..., f]
        assert np.array_equal(np.isnan(a), np.isnan(b)), f"NaN pattern of layer field {f}"
        ok = ~np.isnan(a)
        np.testing.assert_allclose(a[ok], b[ok], rtol=1e-10, atol=1e-12)


def test_full_is_exact_and_topk_has_no_certificate(engine_run):
    _, policies, _, res = engine_run
    full = res.tables.it_cfg == 0
    assert full.sum() == 1
    assert (res.out[full][..., K.F_ERR2] == 0.0).all()
    assert (res.lout[full][..., K.L_ERR2] == 0.0).all()
    for c, p in enumerate(policies):
        rows = res.out[res.tables.it_cfg == c]
        if not p.certified:
            assert np.isnan(rows[..., K.F_CERT2]).all(), p.id
            assert np.isnan(rows[..., K.F_WALD]).all(), p.id
        if p.design is not None and not p.design.randomized and not p.score.seed_dependent:
            assert rows.shape[0] == 1, "deterministic policies are replayed once"
    topk = res.tables.it_cfg == 1
    assert (res.out[topk][..., K.F_ERR2] > 0).any()
    assert (res.out[topk][..., K.F_TAIL] == 0).all()


def test_gqa_certificate_matches_output_space_certificate(engine_run):
    trace, policies, seeds, res = engine_run
    c = 2  # snapkv poisson, one-shot
    it = int(np.flatnonzero(res.tables.it_cfg == c)[1])
    e = res.tables.slot_ev[res.tables.it_slot[it]]
    pi = res.tables.pi[e]
    u = seed_uniforms(seeds, 0, trace.n_kv_heads, trace.n_positions)[res.tables.it_seed[it]]
    qi = res.query_index
    cert = output_space_certificate(trace.queries[:, qi], trace.keys, trace.values, pi, u < pi,
                                    trace.o_proj, scale=trace.scale,
                                    query_positions=res.query_positions)
    np.testing.assert_allclose(res.lout[it, :, K.L_CERT2], cert.variance_trace, rtol=1e-10)
    assert (cert.variance_trace > 0).all()


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_bit_identical_across_threads_and_orders(precision):
    trace = synthetic_trace(5)
    policies = _policies()[:8]
    seeds = np.array([4, 9, 1])
    opts = ReplayOptions(precision=precision)
    one, _ = assert_same_on_one_and_two_threads(trace, policies, seeds, options=opts)
    # Reversed policy list and seed order: the same (policy, seed) results, bit for bit.
    rev = replay_layer(trace, policies[::-1], seeds[::-1], n_layers=2, options=opts)
    for c in range(len(policies)):
        rc = len(policies) - 1 - c
        for s in range(seeds.size):
            i = np.flatnonzero((one.tables.it_cfg == c) & (one.tables.it_seed == s))
            j = np.flatnonzero((rev.tables.it_cfg == rc)
                               & (rev.tables.it_seed == seeds.size - 1 - s))
            if i.size == 0:  # deterministic: one seed only (the first of each list)
                continue
            if j.size == 0:
                continue
            assert one.out[i].tobytes() == rev.out[j].tobytes(), policies[c].id


def test_decode_schedule_uses_running_minimum():
    trace = synthetic_trace(7)
    p = make_policy("h2o", "poisson", 0.3, schedule="decode:4", score_params=SMALL)
    res = replay_layer(trace, [p], np.arange(2), n_layers=1)
    tabs = res.tables
    pis = tabs.pi[tabs.slot_ev[0]:tabs.slot_ev[1]]
    assert pis.shape[0] > 2
    assert (np.diff(pis, axis=0) <= 0).all(), "effective pi never increases"
    # Tokens appended after an event are kept with pi = 1 until the next event.
    for e, t in enumerate(tabs.tau[tabs.slot_ev[0]:tabs.slot_ev[1]]):
        assert (pis[e][:, t:] == 1).all()
    events = res.out[0, 0, :, K.F_EVENT]
    assert (np.diff(events) >= 0).all() and events.max() == pis.shape[0] - 1


def test_question_window_fallback_without_decode_queries():
    trace = synthetic_trace(2, decode=False)
    res = replay_layer(trace, [make_policy("snapkv", "poisson", 0.4, score_params=SMALL)],
                       np.arange(2), n_layers=1)
    assert all(r == "question_window" for r in res.query_roles)
    assert np.isfinite(res.out[..., K.F_ERR2]).all()


def test_output_check_flags_inconsistent_stored_outputs():
    from tracesim.replay.engine import OUTPUT_CHECK_TOLERANCE

    trace = synthetic_trace(1)
    ok = replay_layer(trace, [make_policy("full")], np.arange(1), n_layers=1)
    assert ok.output_check_relative < 1e-10
    trace.outputs[0, -1] += 1.0
    bad = replay_layer(trace, [make_policy("full")], np.arange(1), n_layers=1)
    assert bad.output_check_relative > OUTPUT_CHECK_TOLERANCE


def test_query_chunks_give_the_same_results(monkeypatch):
    """Long contexts run in passes over chunks of queries; every result is unchanged."""
    from tracesim.replay import engine

    trace = synthetic_trace(4)
    policies = _policies()[:6] + [make_policy("tova", "poisson", 0.3, schedule="decode:4")]
    seeds = np.array([0, 3])
    whole = replay_layer(trace, policies, seeds, n_layers=2)
    per_query = trace.n_heads * trace.n_positions * 8
    monkeypatch.setattr(engine, "LOGIT_BUDGET_BYTES", 3 * per_query)
    assert engine.query_chunk(trace.n_heads, whole.query_positions.size,
                              trace.n_positions) == 3
    chunked = replay_layer(trace, policies, seeds, n_layers=2)
    for a, b in ((whole.out, chunked.out), (whole.lout, chunked.lout)):
        assert np.array_equal(np.isnan(a), np.isnan(b))
        ok = ~np.isnan(a)
        np.testing.assert_allclose(a[ok], b[ok], rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(whole.truth_norm, chunked.truth_norm)


#: Documented float32 tolerances (docs/replay.md): squared errors and certificates to
#: 1e-4 |o|^2, other continuous fields to rtol 1e-4 (+ 1e-6 absolute), counts exactly.
F32_SQ = (K.F_ERR2, K.F_CERT2, K.F_CERT2_SMALL, K.F_TRV2)
F32_EXACT = (K.F_TAIL, K.F_KEPT, K.F_EXPECTED, K.F_POP, K.F_EVENT)


def test_float32_mode_agrees_within_documented_tolerance(engine_run):
    trace, policies, seeds, res = engine_run  # float64: matches the reference to 1e-10
    f32 = replay_layer(trace, policies, seeds, n_layers=4,
                       options=ReplayOptions(satterthwaite=True, precision="float32"))
    o2 = (res.truth_norm ** 2)[None, :, :]
    for f in range(K.N_FIELDS):
        a, b = res.out[..., f], f32.out[..., f]
        assert np.array_equal(np.isnan(a), np.isnan(b)), f"NaN pattern of field {f}"
        ok = np.isfinite(a)
        assert np.array_equal(np.isinf(a), np.isinf(b)), f
        if f in F32_EXACT:
            np.testing.assert_array_equal(a[ok], b[ok], err_msg=f"field {f}")
        elif f in F32_SQ:
            assert (np.abs(a - b)[ok] <= 1e-4 * np.broadcast_to(o2, a.shape)[ok]).all(), f
        elif f in (K.F_WALD, K.F_WALD_T):
            assert np.abs(a - b)[ok].mean() <= 0.01, f  # boundary coordinates may flip
        else:
            np.testing.assert_allclose(b[ok], a[ok], rtol=1e-4, atol=1e-6,
                                       err_msg=f"field {f}")
    for f in range(K.N_LAYER_FIELDS):
        a, b = res.lout[..., f], f32.lout[..., f]
        ok = ~np.isnan(a)
        assert np.array_equal(ok, ~np.isnan(b))
        assert np.abs(a - b)[ok].max() <= 1e-4 * np.abs(a[ok]).max(), f
    assert (f32.out[res.tables.it_cfg == 0][..., K.F_ERR2] == 0).all(), "full stays exact"
    with pytest.raises(ValueError, match="precision"):
        ReplayOptions(precision="float16")


def test_serial_and_parallel_set_up_kernels_agree_bit_for_bit(monkeypatch):
    """Small layers run the logits / truth / oracle-statistics kernels serially."""
    from tracesim.kernels import replay_events

    trace = synthetic_trace(6)
    policies = _policies()[:5]
    seeds = np.array([2, 7])
    monkeypatch.setattr(replay_events, "SERIAL_BELOW", 1 << 62)
    serial = replay_layer(trace, policies, seeds, n_layers=2)
    monkeypatch.setattr(replay_events, "SERIAL_BELOW", 0)
    parallel = replay_layer(trace, policies, seeds, n_layers=2)
    assert serial.out.tobytes() == parallel.out.tobytes()
    assert serial.lout.tobytes() == parallel.lout.tobytes()
    assert serial.truth_norm.tobytes() == parallel.truth_norm.tobytes()


def test_take_all_sharing_falls_back_when_a_mask_drops_a_take_all_token(monkeypatch):
    """Seeds share the take-all part of the estimate only when they keep every take-all token;
    a kept mask that drops one is replayed over its whole kept set (checked against the
    reference), and the shared path agrees with the reference too."""
    from tracesim.replay import inclusion

    trace = synthetic_trace(7)
    policies = [make_policy("knorm", "fixed", 0.3, score_params=SMALL),
                make_policy("snapkv", "poisson", 0.3, score_params=SMALL)]
    seeds = np.array([0, 5])
    original = inclusion.fixed_kept

    def dropping(design, pi, u):
        kept = original(design, pi, u)
        kept[0, 0] = 0  # a sink (pi = 1) of KV head 0
        return kept

    monkeypatch.setattr(inclusion, "fixed_kept", dropping)
    res = replay_layer(trace, policies, seeds, n_layers=2,
                       options=ReplayOptions(satterthwaite=True))
    assert (res.tables.pi[:, 0, 0] >= 1).all() and (res.tables.kmask[:, 0, 0] == 0).all()
    ref, lref = reference_replay(trace, policies, seeds, res.tables)
    # tail_out_mass counts eligible (0 < pi < 1) tokens only; the reference also counts the
    # dropped take-all token, a case no design produces (the engine differed there before
    # take-all sharing too), so that field is left out here.
    fields = [f for f in range(K.N_FIELDS) if f != K.F_OUT_MASS]
    for a, b in ((res.out[..., fields], ref[..., fields]), (res.lout, lref)):
        ok = ~np.isnan(b)
        assert np.array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_allclose(a[ok], b[ok], rtol=1e-10, atol=1e-12)
