"""The replay on sliding-window, soft-capped and sink layers, against a loop reference.

A small synthetic layer is given a window shorter than its decode positions, a soft-cap and
per-head sinks; the engine's error, tail size, population and certificate must equal a
token-by-token loop over the window (``(t - w, t]``), and full budget must be exact."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.replay_fixtures import synthetic_trace
from tracesim.kernels import replay as K
from tracesim.policies import make_policy
from tracesim.replay import replay_layer
from tracesim.replay.engine import evaluated_queries
from tracesim.replay.inclusion import event_uniforms, seed_uniforms

VARIANTS = {
    "sliding": {"window": 24},
    "softcap": {"softcap": 1.5},
    "sinks": {"sinks": np.array([0.5, -1.0, 2.0, 0.0])},
    "all": {"window": 24, "softcap": 1.5, "sinks": np.array([0.5, -1.0, 2.0, 0.0])},
}


def _policies():
    return [
        make_policy("full"),
        make_policy("snapkv", "poisson", 1.0, score_params={"window": 8}),
        make_policy("snapkv", "poisson", 0.3, score_params={"window": 8},
                    design_params={"mixture": 0.1}),
        make_policy("perstep", "poisson", 0.3, schedule="step", design_params={"mixture": 0.1},
                    score_params={"window": 8, "proxy": "exact"}),
        make_policy("random", "bernoulli", 0.4, correction="hajek"),
    ]


def _loop(trace, q, g, h, t, pi, kept):
    """Truth, Hájek estimate, tail size and tr V over the query's window, one token at a time."""
    lo = 0 if trace.window is None else max(0, t - trace.window + 1)
    sink = 0.0 if trace.sinks is None else np.exp(trace.sinks[h])
    num, den, enum, eden, tail = 0.0, sink, 0.0, sink, []
    for p in range(lo, t + 1):
        s = q @ trace.keys[g, p] * trace.scale
        if trace.softcap is not None:
            s = trace.softcap * np.tanh(s / trace.softcap)
        num, den = num + np.exp(s) * trace.values[g, p], den + np.exp(s)
        if kept[p]:
            w = np.exp(s) / pi[p]
            enum, eden = enum + w * trace.values[g, p], eden + w
            if pi[p] < 1:
                tail.append((p, w))
    est = enum / eden
    cert = sum((1 - pi[p]) * (w / eden) ** 2 * ((trace.values[g, p] - est) ** 2).sum()
               for p, w in tail)
    return num / den, est, len(tail), cert


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_windowed_soft_capped_sink_replay_matches_a_loop_reference(variant):
    trace = dataclasses.replace(synthetic_trace(5, o_proj=False), **VARIANTS[variant])
    policies, seeds = _policies(), np.array([0, 1])
    res = replay_layer(trace, policies, seeds, n_layers=4)
    tables = res.tables
    qidx = evaluated_queries(trace)
    qpos = trace.query_positions[qidx]
    if trace.window is not None:
        assert (qpos > trace.window + 8).any(), "the window must be shorter than the queries"
    u = seed_uniforms(seeds, trace.layer, trace.n_kv_heads, trace.n_positions)
    G = trace.group_size
    for it in range(tables.it_cfg.size):
        slot, s = tables.it_slot[it], tables.it_seed[it]
        qev = tables.query_event(slot)
        for a, (qi, t) in enumerate(zip(qidx, qpos, strict=True)):
            e = qev[a]
            for h in range(trace.n_heads):
                g = h // G
                ue = event_uniforms(tables, e, int(seeds[s]), trace.layer, g, u[s, g])
                pi = tables.pi[e, g]
                truth, est, m, cert = _loop(trace, trace.queries[h, qi], g, h, int(t), pi,
                                            ue < pi)
                o = res.out[it, h, a]
                assert o[K.F_ERR2] == pytest.approx(((est - truth) ** 2).sum(), rel=1e-8,
                                                    abs=1e-24)
                assert o[K.F_TAIL] == m
                if m:
                    # The engine's one-pass form cancels where the certificate is tiny.
                    assert o[K.F_CERT2] == pytest.approx(cert, rel=1e-8, abs=1e-14)
    # Full budget (no eviction, or a Poisson design at 100 %): zero error.
    for c in (0, 1):
        rows = res.out[tables.it_cfg == c]
        assert (rows[..., K.F_ERR2] < 1e-28).all(), policies[c].id
    assert (res.out[tables.it_cfg == 0][..., K.F_ERR2] == 0.0).all()


def test_a_sliding_layers_budget_is_a_share_of_its_window():
    """At 30 % on a window of 24, the expected kept count of a per-step design is about 30 % of
    the window (plus at most its 2-token take-all window), not of the whole prefix; tokens
    before the window get inclusion probability 0."""
    trace = dataclasses.replace(synthetic_trace(5, o_proj=False), window=24)
    policy = make_policy("perstep", "poisson", 0.3, schedule="step",
                         design_params={"mixture": 0.1},
                         score_params={"window": 2, "sinks": 0, "proxy": "exact"})
    res = replay_layer(trace, [policy], np.array([0]), n_layers=4)
    tables = res.tables
    for e, t in enumerate(tables.tau):
        t = int(t)
        assert (tables.pi[e, :, :max(0, t - 24 + 1)] == 0).all()
        expected = tables.pi[e, :, :t].sum(axis=1)
        assert (expected <= 0.3 * min(t, 24) + 3 + 1e-9).all(), (t, expected)
        assert (expected < 0.3 * t).all(), (t, expected)  # not a share of the prefix


def test_exact_per_step_proxy_is_the_variant_attention():
    """The per-step score's exact proxy forms the softmax as the model does (cap, window, sink):
    it equals the layer's true attention rows."""
    trace = dataclasses.replace(synthetic_trace(5, o_proj=False), **VARIANTS["all"])
    score = make_policy("perstep", "poisson", 0.3, schedule="step",
                        score_params={"window": 8, "proxy": "exact"}).score
    qi = evaluated_queries(trace)[-1]
    t = int(trace.query_positions[qi])
    heads = list(trace.group(1))
    w = score._step_attention(trace, 1, heads, t)
    for a, h in enumerate(heads):
        np.testing.assert_allclose(w[a], trace.attention(h, qi)[:t + 1], rtol=1e-12,
                                   atol=1e-15)


def test_output_space_certificate_of_a_variant_layer_matches_the_public_one():
    """The replay's GQA output-space certificate on a sliding, soft-capped sink layer equals
    :func:`tracesim.output_space_certificate` given the same window, cap and sinks."""
    from tracesim import output_space_certificate

    trace = dataclasses.replace(synthetic_trace(5), **{**VARIANTS["all"], "window": 40})
    policy = make_policy("snapkv", "poisson", 0.5, score_params={"window": 8},
                         design_params={"mixture": 0.1})
    seeds = np.array([0])
    res = replay_layer(trace, [policy], seeds, n_layers=4)
    e = res.tables.slot_ev[res.tables.it_slot[0]]
    pi = res.tables.pi[e]
    u = seed_uniforms(seeds, 0, trace.n_kv_heads, trace.n_positions)[0]
    qi = res.query_index
    cert = output_space_certificate(trace.queries[:, qi], trace.keys, trace.values, pi, u < pi,
                                    trace.o_proj, scale=trace.scale,
                                    query_positions=res.query_positions, window=trace.window,
                                    softcap=trace.softcap, sinks=trace.sinks)
    np.testing.assert_allclose(res.lout[0, :, K.L_CERT2], cert.variance_trace, rtol=1e-8,
                               atol=1e-14)
    assert (cert.variance_trace > 0).all()
