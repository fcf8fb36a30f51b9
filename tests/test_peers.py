"""Peers replayed as their reference code defines them: loop references of each rule, Monte
Carlo of MagicPIG's inclusion probability over hash draws, limits where the answer is exact."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from tests.replay_fixtures import build_store, synthetic_trace
from tracesim.peers import (
    MagicPIG,
    Quest,
    VAttention,
    collision_probability,
    make_peer,
    replay_peers,
    step_inputs,
    vattention_budget,
)
from tracesim.proxies import hyperplanes


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(5, n_heads=4, n_kv=2, d=8, P=160, prompt_length=140)


def _last_decode(trace, head=1):
    return step_inputs(trace, head, int(np.flatnonzero(
        np.array(trace.query_roles) == "decode")[-1]))


def test_collision_probability_matches_monte_carlo_over_hash_draws():
    # Two unit vectors at angle theta; Gaussian hyperplanes: only their 2-D span matters.
    rng = np.random.default_rng(2024)
    K, L, draws = 3, 8, 4_000_000
    for theta in (0.3, 0.8, 1.4):
        q, k = np.array([1.0, 0.0]), np.array([np.cos(theta), np.sin(theta)])
        hits = 0
        for _ in range(8):
            W = rng.standard_normal((draws // 8, L * K, 2))
            agree = ((W @ q) > 0) == ((W @ k) > 0)
            tables = agree.reshape(-1, L, K).all(axis=2).sum(axis=1)
            hits += int((tables >= 2).sum())
        u = collision_probability(np.array([np.cos(theta)]), K, L, 2)[0]
        assert abs(hits / draws - u) <= 1e-3, (theta, hits / draws, u)
    # The closed form of the reference: 1 - (1 - p^K)^L - L p^K (1 - p^K)^(L-1).
    c = np.linspace(-1, 1, 11)
    p = (1 - np.arccos(c) / np.pi) ** 10
    np.testing.assert_allclose(collision_probability(c, 10, 150, 2),
                               1 - (1 - p) ** 150 - 150 * p * (1 - p) ** 149, atol=1e-12)


def test_magicpig_uses_the_keys_that_collide_twice_and_divides_by_u(trace):
    peer = MagicPIG(bits=3, tables=12, sinks=4, local=16)
    x = _last_decode(trace)
    state = peer.prepare(trace.layer, x.kv_head, trace.keys[x.kv_head], trace.prompt_length, 7)
    row = peer.step(x, state, 7, 1.96)
    lo, hi = 4, trace.prompt_length - 16
    mu = trace.keys[x.kv_head, lo:hi].mean(axis=0)
    W = hyperplanes(trace.layer, x.kv_head, 8, 36, seed=7)
    used, weights = [], []
    for j in range(lo, hi):  # loop reference of the collision rule and the weight
        kc = trace.keys[x.kv_head, j] - mu
        hits = sum(all((x.query @ W[:, t * 3 + b] > 0) == (kc @ W[:, t * 3 + b] > 0)
                       for b in range(3)) for t in range(12))
        if hits >= 2:
            used.append(j)
            cos = kc @ x.query / np.linalg.norm(kc) / np.linalg.norm(x.query)
            pk = (1 - np.arccos(np.clip(cos, -1, 1)) / np.pi) ** 3
            weights.append(min(1.0, 1 - (1 - pk) ** 12 - 12 * pk * (1 - pk) ** 11 + 1e-4))
    assert row["sampled"] == len(used) > 0
    dense = list(range(lo)) + list(range(hi, x.step + 1))
    idx = np.array(dense + used)
    s = x.logits[idx] - np.log(np.r_[np.ones(len(dense)), weights])
    w = np.exp(s - s.max())
    ref = (w @ x.values[idx]) / w.sum()
    assert row["err2"] == pytest.approx(float((ref - x.truth) @ (ref - x.truth)), rel=1e-9)
    assert row["kept_tokens"] == len(dense) + len(used)


def _budget_reference(e_base, d_hat, R, eps, delta, n_base):
    m = sum(e_base) / len(e_base)
    var = sum((v - m) ** 2 for v in e_base) / (len(e_base) - 1)
    sigma = max(var ** 0.5, 1e-8)
    z = stats.norm.ppf(1 - delta)
    b = (z * sigma * R / max(eps * d_hat, 1e-8)) ** 2
    b = int(min(max(b, 1), R))  # truncation toward zero, as torch's .long()
    return min(max(b, n_base), R)


def test_vattention_budget_rule_matches_a_loop_reference():
    rng = np.random.default_rng(1)
    for _ in range(300):
        R = int(rng.integers(2, 3000))
        n_base = max(2, int(rng.uniform(0.01, 0.3) * R))
        e = rng.pareto(rng.uniform(0.5, 3.0), size=n_base) * rng.uniform(1e-3, 1)
        d_hat = float(e.sum() * R / n_base * rng.uniform(0.5, 2))
        eps, delta = rng.uniform(0.01, 0.5), rng.uniform(0.01, 0.5)
        assert vattention_budget(e, d_hat, R, eps, delta, n_base) == _budget_reference(
            e, d_hat, R, eps, delta, n_base)


def test_vattention_deterministic_part_and_draws(trace):
    peer = VAttention(sinks=4, local=8, heavy=5, base_rate=0.2, epsilon=0.3, delta=0.2)
    x = _last_decode(trace)
    det = peer.deterministic(x)
    n = x.step + 1
    ref = np.zeros(n, bool)
    ref[:4] = True
    ref[n - 8:] = True
    rest = [j for j in range(n) if not ref[j]]
    for j in sorted(rest, key=lambda j: -x.logits[j])[:5]:  # top-5 among the rest
        ref[j] = True
    np.testing.assert_array_equal(det, ref)
    row = peer.step(x, None, 3, 1.96)
    assert row == peer.step(x, None, 3, 1.96)  # permanent uniforms: same seed, same draws
    assert row != peer.step(x, None, 4, 1.96)
    R = n - 12
    assert 2 <= row["budget_b"] <= R and row["sampled"] <= row["budget_b"]
    assert row["kept_tokens"] == det.sum() + row["sampled"]


def test_quest_selects_top_pages_by_the_bound_like_a_loop(trace):
    x = _last_decode(trace)
    for page, budget in ((16, 0.25), (5, 40), (7, 0.5)):
        peer = Quest(page=page, budget=budget)
        n = x.step + 1
        bounds = []
        for a in range(0, n, page):
            kb = x.keys[a:a + page]
            bounds.append(sum(max(x.query[c] * kb[:, c].min(), x.query[c] * kb[:, c].max())
                              for c in range(kb.shape[1])))
        # the hub's QuestTopKMasker: a float is int(b N) tokens, an int a count
        tokens = int(budget * n) if isinstance(budget, float) else budget
        k = min(max(3, tokens // page), len(bounds))
        order = sorted(range(len(bounds)), key=lambda p: (-bounds[p], p))[:k]
        assert peer.selected_pages(x).tolist() == sorted(order)


def _step_of(n, d=8, seed=0):
    """A decode step over ``n`` random keys (the current token included)."""
    from tracesim.peers import StepInput

    rng = np.random.default_rng(seed)
    q, k, v = rng.normal(size=d), rng.normal(size=(n, d)), rng.normal(size=(n, d))
    logits = k @ q / np.sqrt(d)
    w = np.exp(logits - logits.max())
    return StepInput(layer=0, head=0, kv_head=0, step=n - 1, prompt_length=n - 1, query=q,
                     keys=k, values=v, scale=1 / np.sqrt(d), logits=logits,
                     truth=w @ v / w.sum())


def _quest_loop(x, page, budget):
    """Loop reference of the hub's QuestTopKMasker on one query: kept token mask."""
    n = len(x.logits)
    tokens = int(budget * n) if isinstance(budget, float) else int(budget)
    if n <= max(1, tokens):
        return [True] * n
    bounds = []
    for a in range(0, n, page):
        kb = x.keys[a:a + page]
        bounds.append(sum(max(x.query[c] * kb[:, c].min(), x.query[c] * kb[:, c].max())
                          for c in range(kb.shape[1])))
    k = max(1, min(len(bounds), max(3, tokens // page)))
    chosen = sorted(range(len(bounds)), key=lambda p: (-bounds[p], p))[:k]
    return [j // page in chosen for j in range(n)]


@pytest.mark.parametrize("n, page, budget", [
    (127, 16, 0.5), (127, 1, 0.5), (127, 4, 0.3), (127, 16, 1.0), (127, 16, 127),
    (127, 16, 126), (127, 16, 500), (40, 8, 1), (2, 16, 0.5), (1, 16, 0.25)])
def test_quest_budget_is_the_hubs_to_the_token(n, page, budget):
    x = _step_of(n, seed=n + page)
    row, _, kept = Quest(page=page, budget=budget).attend(x, None, 0, 1.96)
    assert kept.tolist() == _quest_loop(x, page, budget)
    if n <= max(1, int(budget * n) if isinstance(budget, float) else budget):
        assert row["kept_tokens"] == n and row["err2"] < 1e-24  # the hub's full attention


def test_quest_truncates_a_fractional_budget():
    # 0.5 of 127 keys is 63 tokens in the hub (int), not 64 (round): with page 1 that is 63
    # pages, and the earlier round() kept 64
    x = _step_of(127, seed=3)
    assert Quest(page=1, budget=0.5).selected_pages(x).size == 63
    assert Quest(page=1, budget=0.5).label() == "quest(page=1,budget=0.5)"
    assert Quest(page=1, budget=1.0).label() == "quest(page=1,budget=1.0)"
    assert Quest(page=1, budget=64).label() == "quest(page=1,budget=64)"


def _vattention_det_loop(x, sinks, local, heavy):
    n = len(x.logits)
    det = [j < sinks or j >= n - local for j in range(n)]
    k = int(heavy * n) if isinstance(heavy, float) else int(heavy)
    rest = sorted((j for j in range(n) if not det[j]), key=lambda j: (-x.logits[j], j))
    for j in rest[:k]:
        det[j] = True
    return det


@pytest.mark.parametrize("heavy", [0.1, 0.5, 0.99, 3, 0, 0.0])
def test_vattention_heavy_is_the_hubs_size(heavy):
    x = _step_of(127, seed=11)
    peer = VAttention(sinks=4, local=8, heavy=heavy)
    assert peer.deterministic(x).tolist() == _vattention_det_loop(x, 4, 8, heavy)


@pytest.mark.parametrize("params", [{"heavy": 1.0}, {"heavy": 127}, {"heavy": 500},
                                    {"sinks": 127, "heavy": 0}, {"local": 126, "heavy": 0}])
def test_vattention_full_attention_switches_are_the_hubs(params):
    # heavy = 1.0 is int(1.0 N) = N tokens: the hub's top-k masker attends every token;
    # N <= sinks and N <= local + 1 (one query) switch its sink and local maskers to full
    x = _step_of(127, seed=5)
    row, _, kept = VAttention(**{"sinks": 4, "local": 8, **params}).attend(x, None, 0, 1.96)
    assert kept.all() and row["kept_tokens"] == 127 and row["err2"] < 1e-24
    if "heavy" in params and params["heavy"] in (1.0, 127, 500):
        assert row["sampled"] == 0 and row["budget_b"] == 0
    # one token short of each switch samples
    short = {"heavy": 126} if params.get("heavy") in (1.0, 127, 500) else (
        {"sinks": 125, "local": 0, "heavy": 0} if "sinks" in params
        else {"sinks": 0, "local": 124, "heavy": 0})
    row2, _, _ = VAttention(**{"sinks": 4, "local": 8, **short}).attend(x, None, 0, 1.96)
    assert row2["budget_b"] > 0


@pytest.mark.parametrize("name, params", [
    ("quest", {"budget": 2.0}), ("quest", {"budget": 0.0}), ("quest", {"budget": 0}),
    ("vattention", {"heavy": 1.5}), ("vattention", {"heavy": -1})])
def test_hub_sizes_out_of_range_are_refused(name, params):
    with pytest.raises(ValueError, match="budget|heavy"):
        make_peer(name, **params)


def test_peers_are_exact_when_they_keep_everything(trace):
    x = _last_decode(trace)
    n = x.step + 1
    assert Quest(page=16, budget=n + 16).step(x, None, 0, 1.96)["err2"] < 1e-24
    mp = MagicPIG(bits=2, tables=4, sinks=n, local=0)
    st = mp.prepare(trace.layer, x.kv_head, trace.keys[x.kv_head], trace.prompt_length, 0)
    assert mp.step(x, st, 0, 1.96)["err2"] < 1e-24
    va = VAttention(sinks=n, local=0, heavy=0, base_rate=0.1)  # range < 2: full attention
    assert va.step(x, None, 0, 1.96)["err2"] < 1e-24


@pytest.mark.parametrize("name, params, field", [
    ("magicpig", {"bits": 0}, "bits"), ("magicpig", {"bits": 100, "tables": 100}, "K \\* L"),
    ("vattention", {"delta": 1.5}, "delta"), ("vattention", {"epsilon": float("nan")},
                                               "epsilon"),
    ("quest", {"page": 0}, "page"), ("nope", {}, "unknown peer"),
    ("quest", {"bogus": 1}, "bogus")])
def test_bad_peer_parameters_name_the_field(name, params, field):
    with pytest.raises(ValueError, match=field):
        make_peer(name, **params)


def test_replay_peers_rows_and_reproducibility(tmp_path):
    from tracesim.store import open_store

    store = open_store(build_store(tmp_path / "s", n_seqs=1, n_layers=1))
    peers = [MagicPIG(bits=2, tables=6, local=8), VAttention(sinks=4, local=8, heavy=4),
             Quest(page=8, budget=0.5)]
    df = replay_peers(store, peers, [0, 1]).to_pandas()
    pd.testing.assert_frame_equal(df, replay_peers(store, peers, [0, 1]).to_pandas(),
                                  check_exact=True)
    n_steps = 96 - 80  # decode queries of the fixture's first sequence (P - prompt)
    assert len(df) == 4 * n_steps * (2 + 2 + 1)  # heads x steps x (seeds, Quest once)
    assert df.wald_cov[df.peer == "quest"].isna().all()
    assert df.wald_cov[df.peer != "quest"].between(0, 1).all()


def test_peers_cli_writes_results_and_refuses_bad_input(tmp_path, capsys):
    from tracesim.app.cli import main
    from tracesim.dataset_read import read_results

    store = build_store(tmp_path / "s", n_seqs=1, n_layers=2)
    out = tmp_path / "out"
    argv = ["peers", str(store), "--peer", "quest,vattention", "--seeds", "2", "--layers",
            "1", "--params", '{"vattention": {"sinks": 4, "local": 8, "heavy": 4}}', "--quiet"]
    assert main([*argv, "--out", str(out)]) == 0
    first = (out / "results" / "manifest.json").read_bytes()
    df = read_results(out).to_pandas()
    assert set(df.peer) == {"quest", "vattention"} and set(df.layer) == {1}
    for bad, field in ((["--out", str(out)], "exists"), (["--out", ""], "--out"),
                       (["--out", str(store / "x")], "trace store"),
                       (["--params", "[1]", "--out", str(tmp_path / "o2")], "--peer-params"),
                       (["--layers", "7", "--out", str(tmp_path / "o3")], "--layers"),
                       (["--seeds", "0", "--out", str(tmp_path / "o4")], "--seeds")):
        capsys.readouterr()
        assert main([*argv, *bad]) == 2, bad
        err = capsys.readouterr().err
        assert field in err and "expected" in err and "Traceback" not in err
    assert (out / "results" / "manifest.json").read_bytes() == first


def test_magicpig_codes_past_63_bits_and_typed_parameters(trace):
    # 70 bits per table: compared bit by bit (an int64 code would overflow into collisions)
    mp = MagicPIG(bits=70, tables=2, sinks=4, local=16)
    x = _last_decode(trace)
    st = mp.prepare(trace.layer, x.kv_head, trace.keys[x.kv_head], trace.prompt_length, 0)
    assert mp.step(x, st, 0, 1.96)["sampled"] == 0  # 70 equal signs twice: essentially never
    for name, params in (("quest", {"budget": "0.5"}), ("vattention", {"epsilon": "0.2"}),
                         ("vattention", {"delta": True})):
        with pytest.raises(ValueError, match="expected a number"):
            make_peer(name, **params)
