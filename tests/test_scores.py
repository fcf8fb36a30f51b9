"""The oracle score, SnapKV's window sources, refresh under decode:K, the pi floor and the
max_tail_weight diagnostic, against plain-numpy computations."""

from __future__ import annotations

import numpy as np
import pytest

from tests.replay_fixtures import synthetic_layer_arrays, synthetic_trace
from tests.replay_reference import reference_replay
from tracesim.designs import PoissonPPS
from tracesim.kernels import replay as K
from tracesim.policies import LayerTrace, make_policy, make_score
from tracesim.prn import permanent_uniforms
from tracesim.replay import replay_layer
from tracesim.replay.inclusion import head_inclusion

PL, QS, P, D = 80, 74, 96, 8  # prompt length, question start (6 question tokens), positions


def overlap_trace(seed: int = 0) -> LayerTrace:
    """A trace laid out like a real capture whose question is shorter than the window.

    ``context_window`` = the 10 positions before ``question_start``; ``question_window`` = the
    6 question tokens (the rest of the last 10 prompt positions took the ``context_window``
    role first); then every decode step.
    """
    rng = np.random.default_rng(seed)
    pos = np.r_[QS - 10:QS, QS:PL, PL:P].astype(np.int64)
    roles = ["context_window"] * 10 + ["question_window"] * (PL - QS) + ["decode"] * (P - PL)
    a = synthetic_layer_arrays(rng, n_heads=4, n_kv=2, d=D, P=P, prompt_length=PL, qpos=pos,
                               dtype="float64")
    return LayerTrace(layer=0, keys=a["keys"], values=a["values"], queries=a["queries"],
                      outputs=a["outputs"], h2o=a["h2o"].astype(np.float64),
                      query_positions=pos, query_roles=roles, prompt_length=PL,
                      question_start=QS, scale=D**-0.5, sequence_id="overlap")


def np_attention(trace: LayerTrace, h: int, pos: int) -> np.ndarray:
    """Softmax attention of the stored query at position ``pos`` of head ``h``, shape (P,)."""
    i = int(np.flatnonzero(trace.query_positions == pos)[0])
    g = h // trace.group_size
    s = trace.keys[g, :pos + 1] @ trace.queries[h, i] * trace.scale
    w = np.exp(s - s.max())
    out = np.zeros(trace.n_positions)
    out[:pos + 1] = w / w.sum()
    return out


def np_group_mean(trace: LayerTrace, g: int, positions) -> np.ndarray:
    G = trace.group_size
    rows = [np_attention(trace, h, p) for h in range(g * G, (g + 1) * G) for p in positions]
    return np.mean(rows, axis=0)


def np_avgpool(x: np.ndarray, k: int) -> np.ndarray:
    half = k // 2
    pad = np.r_[np.zeros(half), x, np.zeros(half)]
    return np.array([pad[i:i + k].sum() / k for i in range(x.size)])


def np_capped_pps(x: np.ndarray, n: int, mixture: float) -> np.ndarray:
    """Iterate-and-cap capped PPS with the defensive mixture (the textbook loop)."""
    x = (1 - mixture) * x / x.sum() + mixture / x.size
    capped = np.zeros(x.size, dtype=bool)
    while True:
        c = (n - capped.sum()) / x[~capped].sum()
        pi = np.where(capped, 1.0, np.minimum(1.0, c * x))
        new = ~capped & (c * x >= 1.0)
        if not new.any():
            return pi
        capped |= new


# -- oracle -----------------------------------------------------------------------------------
def test_oracle_is_the_decode_queries_group_mean_attention():
    trace = synthetic_trace(4)
    score = make_score("oracle")
    dec = trace.query_positions[[r == "decode" for r in trace.query_roles]]
    for g in range(trace.n_kv_heads):
        ref = np_group_mean(trace, g, dec)[:PL]
        np.testing.assert_allclose(score.scores(trace, g, PL), ref, rtol=1e-12, atol=1e-15)
    assert not score.deployable and make_score("snapkv").deployable
    row = make_policy("oracle", "poisson", 0.25).row()
    assert row["deployable"] is False and row["certified"] is True
    assert make_policy("snapkv", "poisson", 0.25).row()["deployable"] is True
    assert make_policy("full").row()["deployable"] is True


def test_oracle_without_decode_queries_names_the_sequence():
    trace = synthetic_trace(2, decode=False)
    with pytest.raises(ValueError, match=r"oracle: sequence 'syn2' stores no query with "
                                         r"role 'decode'"):
        replay_layer(trace, [make_policy("oracle", "poisson", 0.4)], np.arange(2), n_layers=1)


# -- SnapKV window sources ------------------------------------------------------------------
def test_snapkv_window_sources_read_the_documented_positions():
    trace = overlap_trace()
    last = make_score("snapkv", window=10)
    quest = make_score("snapkv", window=10, window_source="question")
    pos = trace.query_positions
    np.testing.assert_array_equal(pos[last.window_queries(trace, PL)], np.arange(PL - 10, PL))
    np.testing.assert_array_equal(pos[quest.window_queries(trace, PL)], np.arange(QS, PL))
    agnostic = make_score("snapkv", window=10, question_aware=False)
    np.testing.assert_array_equal(pos[agnostic.window_queries(trace, QS)],
                                  np.arange(QS - 10, QS))
    # Without refresh later events reuse the one-shot window.
    np.testing.assert_array_equal(last.window_queries(trace, PL + 8),
                                  last.window_queries(trace, PL))
    with pytest.raises(ValueError, match=r"window_source='last'.*'overlap'.*\[60, 80\)"):
        make_score("snapkv", window=20).scores(trace, 0, PL)
    with pytest.raises(ValueError, match="window_source"):
        make_score("snapkv", window_source="first")
    with pytest.raises(ValueError, match="refresh"):
        make_score("snapkv", refresh=1)


def test_snapkv_last_reproduces_a_plain_numpy_snapkv_replay():
    """Scores, inclusion probabilities and every Hájek error, from scratch in numpy."""
    trace = overlap_trace(1)
    w, budget, mixture, sinks = 10, 0.4, 0.1, 4
    policy = make_policy("snapkv", "poisson", budget, score_params={"window": w},
                         design_params={"mixture": mixture})
    seeds = np.array([0, 5])
    res = replay_layer(trace, [policy], seeds, n_layers=1)
    n_tokens = int(round(budget * PL))
    for g in range(trace.n_kv_heads):
        att = np_group_mean(trace, g, range(PL - w, PL))[:PL]
        x = np_avgpool(att, 5)
        take = np.zeros(PL, dtype=bool)
        take[:sinks] = take[PL - w:] = True
        pi = np.ones(P)
        pi[:PL][~take] = np_capped_pps(x[~take], n_tokens - int(take.sum()), mixture)
        np.testing.assert_allclose(res.tables.pi[0, g], pi, rtol=1e-10, atol=1e-12)
        dec = np.flatnonzero(np.array(trace.query_roles) == "decode")
        for si, s in enumerate(seeds):
            u = permanent_uniforms(int(s), 0, g, np.arange(P))
            kept = u < pi
            for h in trace.group(g):
                for a, qi in enumerate(dec):
                    t = int(trace.query_positions[qi])
                    s_ = trace.keys[g, :t + 1] @ trace.queries[h, qi] * trace.scale
                    e = np.exp(s_ - s_.max())
                    truth = e @ trace.values[g, :t + 1] / e.sum()
                    k = kept[:t + 1]
                    wt = e[k] / pi[:t + 1][k]
                    est = wt @ trace.values[g, :t + 1][k] / wt.sum()
                    err2 = float(((est - truth) ** 2).sum())
                    it = int(np.flatnonzero(res.tables.it_seed == si)[0])
                    np.testing.assert_allclose(res.out[it, h, a, K.F_ERR2], err2, rtol=1e-10,
                                               atol=1e-14)
                    tail = (pi[:t + 1] < 1)[k]
                    mtw = (wt[tail] / wt.sum()).max() if tail.any() else np.nan
                    np.testing.assert_allclose(res.out[it, h, a, K.F_MAX_TAIL], mtw,
                                               rtol=1e-10)


# -- refresh ----------------------------------------------------------------------------------
def test_refresh_definitions():
    trace = overlap_trace(2)
    pos = trace.query_positions
    snap = make_score("snapkv", window=10, refresh=True)
    np.testing.assert_array_equal(snap.window_queries(trace, PL), snap.prompt_window(trace))
    # At tau = PL + 4 the window slides over the 4 decode steps seen so far.
    np.testing.assert_array_equal(pos[snap.window_queries(trace, PL + 4)],
                                  np.arange(PL - 6, PL + 4))
    end = PL + 4
    np.testing.assert_allclose(snap.scores(trace, 1, end),
                               np_avgpool(np_group_mean(trace, 1, range(PL - 6, end))[:end], 5),
                               rtol=1e-12, atol=1e-15)
    kn, knr = make_score("knorm"), make_score("knorm", refresh=True)
    np.testing.assert_array_equal(knr.scores(trace, 0, PL), kn.scores(trace, 0, PL))
    np.testing.assert_allclose(knr.scores(trace, 0, end),
                               np_group_mean(trace, 0, range(PL, end))[:end], rtol=1e-12,
                               atol=1e-15)
    # Before any decode query the refreshed K-norm falls back to the key norm.
    quiet = synthetic_trace(3, decode=False)
    np.testing.assert_array_equal(knr.scores(quiet, 0, 88), kn.scores(quiet, 0, 88))


@pytest.mark.parametrize("score", ["snapkv", "knorm"])
def test_refresh_keeps_the_nested_rule_and_matches_the_reference(score):
    trace = overlap_trace(3)
    sp = {"window": 10}
    plain = make_policy(score, "poisson", 0.3, schedule="decode:4", score_params=sp,
                        design_params={"mixture": 0.1})
    fresh = make_policy(score, "poisson", 0.3, schedule="decode:4",
                        score_params={**sp, "refresh": True}, design_params={"mixture": 0.1})
    seeds = np.arange(3)
    res = replay_layer(trace, [plain, fresh], seeds, n_layers=1)
    tabs = res.tables
    pis = [tabs.pi[tabs.slot_ev[k]:tabs.slot_ev[k + 1]] for k in range(2)]
    assert pis[1].shape[0] >= 3
    assert not np.allclose(pis[0][1:], pis[1][1:]), "refresh changes later events"
    np.testing.assert_array_equal(pis[0][0], pis[1][0])
    for k in range(2):
        assert (np.diff(pis[k], axis=0) <= 0).all(), "effective pi never increases"
        u = np.stack([permanent_uniforms(int(s), 0, g, np.arange(P))
                      for s in seeds for g in range(2)]).reshape(3, 2, P)
        kept = u[:, None] < pis[k][None]  # (seed, event, kv, P)
        assert (kept[:, 1:] <= kept[:, :-1]).all(), "kept sets are nested"
    ref, _ = reference_replay(trace, [plain, fresh], seeds, tabs)
    for f in (K.F_ERR2, K.F_CERT2, K.F_WALD, K.F_NEFF, K.F_MAX_TAIL):
        a, b = res.out[..., f], ref[..., f]
        assert np.array_equal(np.isnan(a), np.isnan(b)), f
        ok = ~np.isnan(a)
        np.testing.assert_allclose(a[ok], b[ok], rtol=1e-10, atol=1e-12)


# -- floor and max_tail_weight ----------------------------------------------------------------
@pytest.mark.parametrize(("mixture", "floor"), [(0.0, 0.1), (0.1, 0.1)])
def test_floor_bounds_pi_and_keeps_the_budget(mixture, floor):
    trace = synthetic_trace(6)
    score = make_score("snapkv", window=8)
    x = score.scores(trace, 0, PL)
    take = score.take_all(trace, 0, PL)
    pi0 = head_inclusion(x, take, PoissonPPS(mixture=mixture), 8)
    pi = head_inclusion(x, take, PoissonPPS(mixture=mixture, floor=floor), 8)
    assert pi[~take].sum() == pytest.approx(8, abs=1e-9)
    assert (pi[~take] >= floor - 1e-12).all() and (pi[take] == 1).all()
    low = ~take & (pi0 < floor)
    assert low.any(), "the floor binds somewhere"
    np.testing.assert_allclose(pi[low], floor, rtol=1e-12)
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="floor"):
            PoissonPPS(floor=bad)


def test_max_tail_weight_is_nan_unless_certified_with_a_tail():
    trace = synthetic_trace(9)
    pols = [make_policy("oracle", "poisson", 0.3, score_params={"window": 8},
                        design_params={"mixture": 0.1}),
            make_policy("oracle", "topk", 0.3, score_params={"window": 8})]
    res = replay_layer(trace, pols, np.arange(4), n_layers=1)
    cert = res.out[res.tables.it_cfg == 0]
    has_tail = cert[..., K.F_TAIL] > 0
    mtw = cert[..., K.F_MAX_TAIL]
    assert has_tail.any() and np.isnan(mtw[~has_tail]).all()
    assert ((mtw[has_tail] > 0) & (mtw[has_tail] <= 1)).all()
    assert np.isnan(res.out[res.tables.it_cfg == 1][..., K.F_MAX_TAIL]).all()
