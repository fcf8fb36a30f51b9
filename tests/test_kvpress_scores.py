"""The kvpress scoring rules ported as scores, against plain loop-based numpy references."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tracesim.policies import LayerTrace, make_policy, make_score, policy_grid
from tracesim.policies.kvpress import KVPRESS_ALIASES, budget_from_compression_ratio
from tracesim.replay import layer_batch, replay_layer


def _trace(P: int = 300, prompt: int = 280, H: int = 4, n_kv: int = 2, d: int = 8,
           seed: int = 0) -> LayerTrace:
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n_kv, P, d)) * rng.uniform(0.5, 2.0, (n_kv, P, 1))
    values = rng.standard_normal((n_kv, P, d))
    qpos = np.concatenate([np.arange(200, 216), np.arange(prompt - 16, prompt),
                           np.arange(prompt, P)])
    roles = ["context_window"] * 16 + ["question_window"] * 16 + ["decode"] * (P - prompt)
    queries = rng.standard_normal((H, qpos.size, d)) * 1.5
    return LayerTrace(layer=0, keys=keys, values=values, queries=queries,
                      h2o=np.abs(rng.standard_normal((H, P))), query_positions=qpos,
                      query_roles=roles, prompt_length=prompt, question_start=216,
                      scale=d**-0.5, sequence_id="t")


# ----------------------------------------------------------------------------- references

def ref_keydiff(k: np.ndarray) -> np.ndarray:
    """kvpress: -cosine(k_i, mean_j k_j/|k_j|)."""
    anchor = np.zeros(k.shape[1])
    for row in k:
        anchor += row / math.sqrt(row @ row)
    anchor /= len(k)
    return np.array([-(row @ anchor) / (math.sqrt(row @ row) * math.sqrt(anchor @ anchor))
                     for row in k])


def _lag_scores(part: np.ndarray, ref: np.ndarray) -> np.ndarray:
    lag, d = part.shape
    raw = np.empty(lag)
    for t in range(lag):
        scaled = [(part[t, j] - ref[:, j].min()) / (ref[:, j].max() - ref[:, j].min())
                  for j in range(d)]
        raw[t] = np.std(scaled, ddof=1)
    e = np.exp(raw - raw.max())
    return e / e.sum()


def ref_lagkv(k: np.ndarray, v: np.ndarray, n_sink: int, lag: int) -> np.ndarray:
    n = len(k)
    out = np.ones(n)
    if n < n_sink + 2 * lag:
        out[n_sink:] = np.arange(n - n_sink) / (n - n_sink)
        return out
    n_part = (n - n_sink) // lag
    for p in range(n_part - 1):
        a, b = n_sink + p * lag, n_sink + (p + 1) * lag
        s = (_lag_scores(k[a:b], k[b:b + lag]) + _lag_scores(v[a:b], v[b:b + lag])) / 2
        ranks = np.empty(lag)
        for t in range(lag):
            ranks[t] = sum(s[u] < s[t] or (s[u] == s[t] and u < t) for u in range(lag))
        out[a:b] = ranks / lag
    return out


def ref_cur(k: np.ndarray, v: np.ndarray, w: int, kind: str) -> np.ndarray:
    n = len(k)
    k2 = np.array([row @ row for row in k])
    v2 = np.array([row @ row for row in v])
    for x in (k2, v2):
        for a in range(0, n, w):
            x[a:a + w] = x[a:a + w] / x[a:a + w].sum()
    x = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[kind]
    return x / x.sum()


def ref_expected(trace: LayerTrace, g: int, end: int, sinks: int) -> np.ndarray:
    out = np.zeros(end - sinks)
    G = trace.group_size
    qsel = [i for i, p in enumerate(trace.query_positions) if sinks <= p < end]
    for h in range(g * G, (g + 1) * G):
        q = trace.queries[h, qsel]
        mu = q.mean(axis=0)
        cov = sum(np.outer(r - mu, r - mu) for r in q) / len(q)
        s = np.array([trace.scale * (trace.keys[g, i] @ mu)
                      + 0.5 * trace.scale**2 * (trace.keys[g, i] @ cov @ trace.keys[g, i])
                      for i in range(sinks, end)])
        e = np.exp(s - s.max())
        out += e / e.sum()
    out /= G
    return out * np.linalg.norm(trace.values[g, sinks:end], axis=1)


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("end", [280, 57])
def test_keydiff_matches_reference_order_and_values(end):
    t = _trace()
    for g in range(2):
        got = make_score("keydiff").scores(t, g, end)
        ref = ref_keydiff(t.keys[g, :end])
        np.testing.assert_allclose(got, 1.0 + ref, rtol=1e-12, atol=1e-12)
        assert (got >= 0).all()


@pytest.mark.parametrize("end,lag", [(280, 32), (280, 128), (60, 32)])
def test_lagkv_matches_reference(end, lag):
    t = _trace()
    for g in range(2):
        got = make_score("lagkv", lag_size=lag).scores(t, g, end)
        ref = ref_lagkv(t.keys[g, :end], t.values[g, :end], 4, lag)
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12)
    if end >= 4 + 2 * lag:  # partitions are scored, the last one and the sinks are 1
        assert got[:4].tolist() == [1.0] * 4 and (got[4:4 + lag] < 1).all()


@pytest.mark.parametrize("kind", ["key", "value", "kv_avg", "kv_product"])
def test_cur_matches_reference(kind):
    t = _trace()
    got = make_score("cur", leverage=kind, local_window=16).scores(t, 1, 250)
    np.testing.assert_allclose(got, ref_cur(t.keys[1, :250], t.values[1, :250], 16, kind),
                               rtol=1e-12)
    assert math.isclose(got.sum(), 1.0)


def test_expected_attention_matches_reference():
    t = _trace()
    s = make_score("expected_attention")
    for g in range(2):
        got = s.scores(t, g, 280)
        ref = ref_expected(t, g, 280, 4)
        np.testing.assert_allclose(got[4:], ref, rtol=1e-10)
        assert (got[:4] > ref.max()).all()
    # Only queries at positions < end are read: later queries do not change the scores.
    t2 = _trace()
    t2.queries[:, t2.query_positions >= 280] += 100.0
    np.testing.assert_array_equal(s.scores(t2, 0, 280), s.scores(t, 0, 280))


def test_validation_and_budget_convention():
    with pytest.raises(ValueError, match="lag_size"):
        make_score("lagkv", lag_size=0)
    with pytest.raises(ValueError, match="leverage"):
        make_score("cur", leverage="both")
    with pytest.raises(ValueError, match="compression_ratio"):
        budget_from_compression_ratio(1.0)
    assert budget_from_compression_ratio(0.75) == 0.25
    for alias, (name, _) in KVPRESS_ALIASES.items():
        assert make_score(alias).name == name


def test_ported_scores_replay_with_every_design():
    t = _trace()
    policies = policy_grid(["keydiff", "lagkv", "cur", "expected_attention"],
                           ["topk", "poisson", "fixed"], [0.3],
                           score_params={"lagkv": {"lag_size": 32}})
    policies.append(make_policy("observed_attention", "poisson", 0.3))
    res = replay_layer(t, policies, np.arange(3), 1)
    batch = layer_batch(res, per_seed=False).to_pandas()
    assert set(batch["score"]) == {"keydiff", "lagkv", "cur", "expected_attention",
                                   "ObservedAttentionPress"}
    assert np.isfinite(batch["err2"]).all()
