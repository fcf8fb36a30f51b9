"""kvpress parity down to the kept set: every press alias against a loop-based reference.

Each reference is written from kvpress's own ``score`` (scores per KV head as the press
computes them) and ``ScorerPress.compress`` (``n_kept = int(k_len * (1 - ratio))``, then the
top ``n_kept`` scores). ``torch.topk`` leaves the order of equal scores unspecified; the aliases
keep the earlier position (what CUDA's topk does), and so does the reference (a token's rank
counts the higher scores and the equal scores at earlier positions).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tests.test_kvpress_scores import ref_cur, ref_keydiff, ref_lagkv
from tracesim.policies import LayerTrace, Policy, make_policy, make_score
from tracesim.policies.kvpress import (
    KVPRESS_ALIASES,
    KVPRESS_PRESSES,
    budget_from_compression_ratio,
)
from tracesim.replay.kept import first_event_inclusion

H, N_KV, D, THETA, N_DEC = 6, 3, 16, 10000.0, 4
ROPE = {"rope_theta": THETA, "rope_scaling": {"rope_type": "default"}}
LENGTHS = [250, 768, 777, 901, 1008, 1024]
RATIOS = [0.25, 0.5, 0.75, 0.9]


# ----------------------------------------------------------------------------- the trace

def rope_rotate(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Hugging Face RoPE, pair by pair: (x_i, x_{i+d/2}) turned by p / theta^(2i/d)."""
    out = x.copy()
    h = x.shape[-1] // 2
    for i in range(h):
        ang = positions * THETA ** (-2 * i / x.shape[-1])
        c, s = np.cos(ang), np.sin(ang)
        out[..., i] = x[..., i] * c - x[..., i + h] * s
        out[..., i + h] = x[..., i + h] * c + x[..., i] * s
    return out


def kvpress_trace(L: int, seed: int = 0, duplicates: bool = True) -> tuple[LayerTrace, dict]:
    """A store-like layer: every prompt position's query stored (``--all-positions``), the
    usual window roles, a few decode steps; keys and queries carry real RoPE. With
    ``duplicates`` some keys repeat an earlier key vector exactly (exact norm / cosine ties)."""
    rng = np.random.default_rng(seed + L)
    P = L + N_DEC
    pos = np.arange(P)
    k_pre = rng.standard_normal((N_KV, P, D)) * rng.uniform(0.5, 2.0, (N_KV, P, 1))
    q_pre = rng.standard_normal((H, P, D)) * 1.5 + rng.standard_normal((H, 1, D))
    v = rng.standard_normal((N_KV, P, D))
    if duplicates:
        src = rng.choice(L // 2, size=L // 16, replace=False)
        dst = L // 2 + rng.choice(L // 2, size=src.size, replace=False)
        k_pre[:, dst] = k_pre[:, src]
    keys = rope_rotate(k_pre, pos)
    if duplicates:  # the same vector after RoPE (exact ties of norm and cosine)
        keys[:, dst] = keys[:, src]
    q = rope_rotate(q_pre, pos)
    scale = D**-0.5
    G = H // N_KV
    att = np.empty((H, P, P))
    for h in range(H):
        s = q[h] @ keys[h // G].T * scale
        s[np.triu_indices(P, 1)] = -np.inf
        w = np.exp(s - s.max(axis=1, keepdims=True))
        att[h] = w / w.sum(axis=1, keepdims=True)
    qs = L - 20
    roles = {}
    for p in range(qs - 64, qs):
        roles[p] = "context_window"
    for p in range(L - 64, L):
        roles.setdefault(p, "question_window")
    for p in range(L, P):
        roles[p] = "decode"
    for p in range(P):
        roles.setdefault(p, "all")
    trace = LayerTrace(layer=0, keys=keys, values=v, queries=q, h2o=att[:, :L].sum(axis=1),
                       query_positions=pos.astype(np.int64), query_roles=[roles[p] for p in pos],
                       prompt_length=L, question_start=qs, scale=scale, sequence_id=f"L{L}",
                       rope=ROPE)
    return trace, {"att": att, "q_pre": q_pre}


_CACHE: dict[tuple[int, bool], tuple[LayerTrace, dict]] = {}


def get_trace(L: int, duplicates: bool = True) -> tuple[LayerTrace, dict]:
    if (L, duplicates) not in _CACHE:
        _CACHE[(L, duplicates)] = kvpress_trace(L, duplicates=duplicates)
    return _CACHE[(L, duplicates)]


# ----------------------------------------------------------------------------- references

def ref_streaming(L: int, ratio: float, n_sink: int = 4) -> np.ndarray:
    n_pruned = L - int(L * (1 - ratio))
    s = np.ones(L)
    s[n_sink:n_sink + n_pruned] = 0.0
    return s


def ref_observed(att: np.ndarray, L: int, g: int) -> np.ndarray:
    G = H // N_KV
    out = np.zeros(L)
    for h in range(g * G, (g + 1) * G):
        summed = att[h, :L, :L].sum(axis=0)
        out += np.array([summed[i] / (L - i) for i in range(L)])
    return out / G


def ref_snapkv(att: np.ndarray, L: int, g: int, window: int = 64, kernel: int = 5):
    G = H // N_KV
    n = L - window
    out = np.zeros(n)
    for h in range(g * G, (g + 1) * G):
        mean = att[h, L - window:L, :n].mean(axis=0)
        pooled = np.zeros(n)
        for i in range(n):  # avg_pool1d, zero padding kernel // 2, count_include_pad
            pooled[i] = sum(mean[j] for j in range(i - kernel // 2, i + kernel // 2 + 1)
                            if 0 <= j < n) / kernel
        out += pooled
    out /= G
    return np.concatenate([out, np.full(window, out.max() + 1)])


def ref_tova(att: np.ndarray, L: int) -> np.ndarray:
    s = att[:, L - 1, :L - 1].mean(axis=0)
    return np.concatenate([s, [s.max() + 1]])


def ref_knorm(keys: np.ndarray) -> np.ndarray:
    return np.array([-math.sqrt(row @ row) for row in keys])


def _rope_matrix(p: int) -> np.ndarray:
    R = np.zeros((D, D))
    h = D // 2
    for i in range(h):
        a = p * THETA ** (-2 * i / D)
        R[i, i], R[i, i + h] = math.cos(a), -math.sin(a)
        R[i + h, i], R[i + h, i + h] = math.sin(a), math.cos(a)
    return R


def ref_expected(trace: LayerTrace, q_pre: np.ndarray, L: int, g: int, n_sink: int = 4,
                 n_future: int = 512) -> np.ndarray:
    R = sum(_rope_matrix(p) for p in range(L, L + n_future)) / n_future
    G = H // N_KV
    keys = trace.keys[g, n_sink:L]
    out = np.zeros(L - n_sink)
    for h in range(g * G, (g + 1) * G):
        q = q_pre[h, n_sink:L]
        mu = q.mean(axis=0)
        cov = sum(np.outer(r - mu, r - mu) for r in q) / len(q)
        mu, cov = R @ mu, R @ cov @ R.T
        s = np.array([k @ mu / math.sqrt(D) + k @ cov @ k / D / 2 for k in keys])
        e = np.exp(s - s.max())
        out += e / e.sum()
    out = out / G * np.linalg.norm(trace.values[g, n_sink:L], axis=1)
    return np.concatenate([np.full(n_sink, out.max() + 1), out])


_REF: dict[tuple[str, int, int], np.ndarray] = {}


def ref_scores(press: str, trace: LayerTrace, extra: dict, L: int, g: int,
               ratio: float) -> np.ndarray:
    if press == "StreamingLLMPress":
        return ref_streaming(L, ratio)
    key = (press, L, g)
    if key not in _REF or trace is not get_trace(L)[0]:
        _REF[key] = _ref_scores(press, trace, extra, L, g)
    return _REF[key]


def _ref_scores(press: str, trace: LayerTrace, extra: dict, L: int, g: int) -> np.ndarray:
    k, v, att = trace.keys[g, :L], trace.values[g, :L], extra["att"]
    if press == "ObservedAttentionPress":
        return ref_observed(att, L, g)
    if press == "SnapKVPress":
        return ref_snapkv(att, L, g)
    if press == "TOVAPress":
        return ref_tova(att, L)
    if press == "KnormPress":
        return ref_knorm(k)
    if press == "KeyDiffPress":
        return ref_keydiff(k)
    if press == "LagKVPress":
        return ref_lagkv(k, v, 4, 128)
    if press == "CURPress":
        s = ref_cur(k, v, 16, "kv_product")
        s[:4] = 1.0
        return s
    if press == "ExpectedAttentionPress":
        return ref_expected(trace, extra["q_pre"], L, g)
    raise KeyError(press)


def ref_kept(scores: np.ndarray, ratio: float) -> np.ndarray:
    """``scores.topk(int(k_len * (1 - ratio)))``, equal scores: the earlier position first."""
    n = scores.size
    n_kept = int(n * (1 - ratio))
    i = np.arange(n)
    higher = (scores[None, :] > scores[:, None]) | (
        (scores[None, :] == scores[:, None]) & (i[None, :] < i[:, None]))
    return higher.sum(axis=1) < n_kept


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    return float((a & b).sum() / max(1, (a | b).sum()))


def alias_kept(press: str, trace: LayerTrace, ratio: float) -> np.ndarray:
    policy = make_policy(press, "topk", budget_from_compression_ratio(ratio))
    _, kept = first_event_inclusion(trace, policy, 0, 1)
    assert kept[:, trace.prompt_length:].all()  # decode positions are not compressed yet
    return kept[:, :trace.prompt_length]


DETERMINISTIC = [p for p in KVPRESS_PRESSES if p != "RandomPress"]


def measure(press: str, L: int, ratio: float) -> list[float]:
    trace, extra = get_trace(L)
    kept = alias_kept(press, trace, ratio)
    out = []
    for g in range(N_KV):
        ref = ref_kept(ref_scores(press, trace, extra, L, g, ratio), ratio)
        out.append(jaccard(kept[g], ref))
    return out


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("press", DETERMINISTIC)
def test_alias_kept_set_equals_the_press_reference(press, L):
    for ratio in RATIOS:
        n_kept = int(L * (1 - ratio))
        trace, extra = get_trace(L)
        kept = alias_kept(press, trace, ratio)
        for g in range(N_KV):
            ref = ref_kept(ref_scores(press, trace, extra, L, g, ratio), ratio)
            assert kept[g].sum() == n_kept == ref.sum(), (press, L, ratio, g)
            np.testing.assert_array_equal(kept[g], ref, err_msg=f"{press} L={L} r={ratio}")


@pytest.mark.parametrize("press", DETERMINISTIC)
def test_budgets_below_the_protected_tokens(press):
    # 2 and 1 kept tokens of 250: fewer than the sinks / window / last token kvpress protects
    # by score; it keeps the earliest protected ones.
    trace, extra = get_trace(250)
    for ratio in (0.99, 0.995):
        kept = alias_kept(press, trace, ratio)
        for g in range(N_KV):
            ref = ref_kept(ref_scores(press, trace, extra, 250, g, ratio), ratio)
            np.testing.assert_array_equal(kept[g], ref, err_msg=f"{press} r={ratio}")


def test_budget_is_kvpress_int_truncation():
    trace, _ = get_trace(777)
    for ratio in (0.3, 0.7, 0.75, 0.33):
        kept = alias_kept("KnormPress", trace, ratio)
        assert (kept.sum(axis=1) == int(777 * (1 - ratio))).all()
        # the tracesim name rounds (and keeps its sinks and window)
        p = make_policy("knorm", "topk", budget_from_compression_ratio(ratio))
        _, k2 = first_event_inclusion(trace, p, 0, 1)
        assert (k2[:, :777].sum(axis=1) == round(777 * (1 - ratio))).all()


def test_ties_go_to_the_earlier_position():
    trace, _ = get_trace(768)
    # LagKV at 768 tokens: the sinks (4) and the tail (the last partition [516, 644) and the
    # remainder, 252 tokens) all score 1 and 192 are kept: the 4 sinks and the tail's first 188.
    kept = alias_kept("LagKVPress", trace, 0.75)
    want = np.zeros(768, bool)
    want[:4] = True
    want[516:516 + 188] = True
    for g in range(N_KV):
        np.testing.assert_array_equal(kept[g], want)
    # KnormPress with exactly equal key norms at the threshold: the earlier copy is kept.
    t = kvpress_trace(300, duplicates=False)[0]
    norms = np.linalg.norm(t.keys[0, :300], axis=1)
    order = np.argsort(-norms, kind="stable")
    n_kept = int(300 * 0.5)
    a, b = sorted(order[n_kept - 5:n_kept + 5:9])  # one kept, one not
    t.keys[:, a] = t.keys[:, b] = t.keys[:, order[n_kept - 1]]
    kept = alias_kept("KnormPress", t, 0.5)
    ref = ref_kept(ref_knorm(t.keys[0, :300]), 0.5)
    np.testing.assert_array_equal(kept[0], ref)
    tied = np.flatnonzero(np.isclose(ref_knorm(t.keys[0, :300]), -norms[order[n_kept - 1]],
                                     rtol=0, atol=0))
    assert tied.size >= 2 and kept[0, tied].tolist() == sorted(kept[0, tied].tolist())[::-1]


def test_tova_press_ranks_every_kv_head_alike_and_tova_keeps_the_group():
    trace, extra = get_trace(901)
    kept = alias_kept("TOVAPress", trace, 0.75)
    assert (kept == kept[0]).all() and kept[:, 900].all()
    _, k2 = first_event_inclusion(trace, make_policy("tova", "topk", 0.25), 0, 1)
    assert not (k2[:, :901] == k2[0, :901]).all()


def test_snapkv_press_pools_before_the_window_only():
    trace, extra = get_trace(1008)
    s = make_score("SnapKVPress").scores(trace, 1, 1008)
    np.testing.assert_allclose(s, ref_snapkv(extra["att"], 1008, 1), rtol=1e-12)
    # the tracesim snapkv pools across the window edge: the last pre-window scores differ
    t = make_score("snapkv", window=64, sinks=0).scores(trace, 1, 1008)
    assert not np.isclose(t[943], s[943], rtol=1e-9) and np.isclose(t[900], s[900])


def test_expected_attention_press_needs_the_rope_settings():
    trace, _ = get_trace(250)
    old = LayerTrace(**{**{f: getattr(trace, f) for f in (
        "layer", "keys", "values", "queries", "h2o", "query_positions", "query_roles",
        "prompt_length", "question_start", "scale", "sequence_id")}, "rope": None})
    with pytest.raises(ValueError, match="lacks the model's RoPE settings.*re-capture"):
        make_score("ExpectedAttentionPress").scores(old, 0, 250)
    bad = dict(trace.rope, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    old.rope = bad
    with pytest.raises(ValueError, match="yarn"):
        make_score("ExpectedAttentionPress").scores(old, 0, 250)


def test_aliases_and_names():
    for alias, (name, _) in KVPRESS_ALIASES.items():
        assert make_score(alias).name == name
    for name, cls in KVPRESS_PRESSES.items():
        s = make_score(name)
        assert type(s) is cls and s.ties == "earlier" and s.label().startswith(name + "(")
        p = make_policy(name, "topk", 0.25)
        assert Policy.from_dict(json.loads(p.to_json())) == p and p.row()["score"] == name
    for name in ("snapkv", "tova", "knorm", "keydiff", "lagkv", "streaming", "h2o"):
        assert make_score(name).ties == "later"


def test_random_press_keeps_the_kvpress_budget():
    trace, _ = get_trace(777)
    kept = alias_kept("RandomPress", trace, 0.75)
    assert (kept.sum(axis=1) == int(777 * 0.25)).all()


def test_press_aliases_with_a_randomized_design():
    trace, _ = get_trace(250)
    for press in ("SnapKVPress", "LagKVPress", "TOVAPress", "ExpectedAttentionPress"):
        policy = make_policy(press, "poisson", 0.3)
        pi, _ = first_event_inclusion(trace, policy, 0, 1)
        assert np.isfinite(pi).all() and ((pi >= 0) & (pi <= 1)).all()
        take_all = int(policy.score.take_all(trace, 0, 250).sum())
        tail = pi[:, :250].sum(axis=1) - take_all
        np.testing.assert_allclose(tail, int(250 * 0.3) - take_all, rtol=1e-9)


def test_score_free_merging_respects_the_press_budget_rule():
    from tracesim.policies.redundancy import merge_score_free

    ps = [make_policy(n, "bernoulli", 0.25) for n in ("KnormPress", "KeyDiffPress")]
    ps.append(make_policy("keydiff", "bernoulli", 0.25, score_params={"sinks": 0}))
    kept, notes = merge_score_free(ps)
    assert [p.score.name for p in kept] == ["KnormPress", "keydiff"] and len(notes) == 1


def test_lagkv_press_over_many_lengths():
    # The sweep: random keys at 300-1300 tokens (tracesim's old alias: mean J 0.70,
    # min 0.00). The scores are lagkv's (checked against the loop reference in
    # test_kvpress_scores); the kept set is kvpress's rule on them.
    rng = np.random.default_rng(5)
    for L in range(300, 1301, 53):
        keys = rng.standard_normal((1, L, 8))
        t = LayerTrace(layer=0, keys=keys, values=rng.standard_normal((1, L, 8)),
                       queries=keys[:, -1:], h2o=np.zeros((1, L)),
                       query_positions=np.array([L - 1]), query_roles=["question_window"],
                       prompt_length=L, question_start=L - 1, scale=8**-0.5)
        scores = make_score("lagkv").scores(t, 0, L)
        for ratio in (0.5, 0.75, 0.9):
            np.testing.assert_array_equal(alias_kept("LagKVPress", t, ratio)[0],
                                          ref_kept(scores, ratio), err_msg=f"L={L} r={ratio}")
