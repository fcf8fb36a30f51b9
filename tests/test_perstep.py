"""Per-step designs: proxies, a fresh (or permanent) Poisson sample at every decode step.

Ground truth: loop references of each proxy's rule, exact enumeration of every sample of a small
tail at one step, Monte Carlo over seeds for the per-step uniforms, and the engine against the
plain-numpy reference (``tests/test_replay_engine.py`` replays per-step policies too).
"""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest

from tests.replay_fixtures import assert_same_on_one_and_two_threads, synthetic_trace
from tracesim.policies import make_policy, make_score
from tracesim.policies.grid import expand_grid
from tracesim.proxies import (
    ExactProxy,
    LowRankProxy,
    PageProxy,
    QuantProxy,
    SimHashProxy,
    hyperplanes,
    make_proxy,
    quantise_keys,
)
from tracesim.replay import ReplayOptions, replay_layer
from tracesim.replay.inclusion import event_uniforms, seed_uniforms

PROXY_SPECS = ("exact", "quant:4", "quant:1", "lowrank:4", "pages:4", "simhash:4,32")


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(7, n_heads=4, n_kv=2, d=8, P=96, prompt_length=80)


# ----------------------------------------------------------------------------- proxies


def test_exact_and_full_rank_proxies_give_the_logits(trace):
    q = trace.queries[:2, -1]
    truth = q @ trace.keys[0, :90].T * trace.scale
    np.testing.assert_allclose(ExactProxy().logits(trace, 0, q, 90), truth, rtol=0, atol=1e-12)
    np.testing.assert_allclose(LowRankProxy(rank=8).logits(trace, 0, q, 90), truth, atol=1e-10)
    assert np.abs(LowRankProxy(rank=2).logits(trace, 0, q, 90) - truth).max() > 1e-3


def test_quantised_keys_are_within_half_a_step_of_every_entry():
    rng = np.random.default_rng(0)
    K = rng.standard_normal((70, 8)) * 3
    K[:, 5] = 1.25  # a constant channel is exact
    for bits in (1, 2, 4, 8):
        Kq = quantise_keys(K, bits, 32)
        for a in range(0, 70, 32):  # a loop over groups and channels
            block, qb = K[a:a + 32], Kq[a:a + 32]
            for c in range(8):
                lo, hi = block[:, c].min(), block[:, c].max()
                step = (hi - lo) / (2**bits - 1)
                assert np.abs(qb[:, c] - block[:, c]).max() <= step / 2 + 1e-12
                levels = np.rint((qb[:, c] - lo) / step) if step > 0 else np.zeros(len(qb))
                assert ((levels >= 0) & (levels <= 2**bits - 1)).all()
        assert (Kq[:, 5] == 1.25).all()
    assert QuantProxy(bits=4).bits_per_token(64) == 64 * (4 + 1)


def test_quant_logits_read_the_residual_in_full_precision_in_any_step_order(trace):
    """The complete groups quantised, the rest exact, whichever steps came before."""
    proxy = QuantProxy(bits=4, group=8)
    q = trace.queries[:2, -1]
    Kq = quantise_keys(trace.keys[0], 4, 8)
    for end in (90, 20, 21, 95, 17, 20):
        full = end // 8 * 8
        K = np.concatenate([Kq[:full], trace.keys[0, full:end]])
        np.testing.assert_array_equal(proxy.logits(trace, 0, q, end), (q @ K.T) * trace.scale)


def test_quant_step_logits_computed_ahead_equal_each_steps_own_product(trace, monkeypatch):
    """The steps sharing a ``full`` read their logits from one product over their queries; in
    any step order (and with the look-ahead cut to 3 queries) each equals the step's own
    product to rounding (another summation order: 1e-12 relative, not bit for bit)."""
    import tracesim.proxies.quant as quant

    proxy = QuantProxy(bits=4, group=8)
    heads = [0, 1]
    steps = [(int(p), i) for i, p in enumerate(trace.query_positions)
             if trace.query_roles[i] == "decode"]
    assert len(steps) >= 4
    for limit in (quant.STEP_LOGIT_BYTES, 3 * 8 * len(heads) * trace.n_positions):
        monkeypatch.setattr(quant, "STEP_LOGIT_BYTES", limit)
        trace._attention_cache.clear()
        for end, qi in steps[::-1] + steps + steps[1::2]:
            got = proxy.step_logits(trace, 0, heads, qi, end)
            want = proxy.logits(trace, 0, trace.queries[heads, qi], end)
            assert got.shape == want.shape == (2, end)
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_page_bounds_bound_every_logit_of_their_page(trace):
    q = trace.queries[:, -1]
    for page in (1, 3, 4, 16):
        for g in range(trace.n_kv_heads):
            heads = list(trace.group(g))
            bound = PageProxy(page=page).logits(trace, g, q[heads], 90)
            exact = q[heads] @ trace.keys[g, :90].T * trace.scale
            assert (bound >= exact - 1e-12).all()
            for j in range(0, 90, page):  # a page's tokens share one bound, attained at page 1
                assert np.ptp(bound[:, j:min(j + page, 90)], axis=1).max() == 0
            if page == 1:
                np.testing.assert_allclose(bound, exact, atol=1e-12)


def test_simhash_angles_converge_and_hyperplanes_are_permanent(trace):
    a = hyperplanes(0, 1, 8, 64)
    np.testing.assert_array_equal(a, hyperplanes(0, 1, 8, 64))
    assert not np.array_equal(a, hyperplanes(1, 1, 8, 64))
    q = trace.queries[2:4, -1]
    mu = trace.keys[1, :trace.prompt_length].mean(axis=0)
    Kc = trace.keys[1, :90] - mu
    cos = (q @ Kc.T) / np.linalg.norm(q, axis=1)[:, None] / np.linalg.norm(Kc, axis=1)[None]
    err = {}
    for L in (8, 400):
        est = SimHashProxy(bits=8, tables=L).logits(trace, 1, q, 90) / trace.scale - (q @ mu)[:,
                                                                                        None]
        cos_hat = est / np.linalg.norm(q, axis=1)[:, None] / np.linalg.norm(Kc, axis=1)[None]
        err[L] = np.abs(cos_hat - cos).mean()
    assert err[400] < 0.05 < err[8]


@pytest.mark.parametrize("spec, field", [("quant:3", "bits"), ("quant:4,0", "group"),
                                         ("simhash:100,100", "K * L"), ("nope", "unknown proxy"),
                                         ("lowrank:x", "rank"), ("pages:0", "page")])
def test_bad_proxy_specs_name_the_field(spec, field):
    with pytest.raises(ValueError, match=field.replace("*", r"\*")):
        make_proxy(spec)


def test_lowrank_above_head_dim_and_missing_decode_queries_are_refused(trace):
    p = make_policy("perstep", "poisson", 0.3, schedule="step", score_params={
        "proxy": "lowrank:9", "window": 8})
    with pytest.raises(ValueError, match="rank = 9 > head_dim = 8"):
        replay_layer(trace, [p], np.arange(1), n_layers=2)
    no_decode = synthetic_trace(7, decode=False)
    p = make_policy("perstep", "poisson", 0.3, schedule="step", score_params={"window": 8})
    with pytest.raises(ValueError, match="no decode query"):
        make_score("perstep", window=8).scores(no_decode, 0, int(no_decode.query_positions[-1]))
    with pytest.raises(ValueError):
        replay_layer(no_decode, [p], np.arange(1), n_layers=2,
                     options=ReplayOptions(roles=("question_window",)))


def test_schedule_and_score_must_agree():
    with pytest.raises(ValueError, match="needs a per-step score"):
        make_policy("snapkv", "poisson", 0.25, schedule="step")
    with pytest.raises(ValueError, match="expected schedule 'step'"):
        make_policy("perstep", "poisson", 0.25)
    with pytest.raises(ValueError, match="coordination"):
        make_policy("perstep", "poisson", 0.25, schedule="step:sometimes")
    grid = expand_grid({"score": ["snapkv", "perstep"], "design": ["poisson"],
                        "budget": [0.25], "schedule": ["oneshot", "step", "step:permanent"]})
    ids = sorted(p.id for p in grid.policies)
    assert len(ids) == 3 and sum("step(permanent)" in i for i in ids) == 1
    assert any("per-step" in s for s in grid.skipped)


# ----------------------------------------------------------------- the design at one step


def _step_tables(trace, policy, seeds=(0,)):
    res = replay_layer(trace, [policy], np.asarray(seeds), n_layers=2)
    return res, res.tables


def test_step_scores_follow_each_query_and_the_gqa_rule(trace):
    t = int(trace.query_positions[-3])
    qi = int(np.flatnonzero(trace.query_positions == t)[0])
    for gqa in ("mean", "max"):
        x = make_score("perstep", proxy="exact", gqa=gqa, window=8).scores(trace, 1, t)
        rows = []
        for h in trace.group(1):  # loop reference: softmax over [0, t] of each head
            s = np.array([trace.queries[h, qi] @ trace.keys[1, i] * trace.scale
                          for i in range(t + 1)])
            w = np.exp(s - s.max())
            rows.append(w / w.sum())
        ref = np.mean(rows, axis=0) if gqa == "mean" else np.max(rows, axis=0)
        np.testing.assert_allclose(x, ref[:t], rtol=1e-12, atol=1e-15)


def test_every_step_has_its_own_pi_and_budget(trace):
    pol = make_policy("perstep", "poisson", 0.3, schedule="step",
                      design_params={"mixture": 0.1}, score_params={"window": 8})
    res, tab = _step_tables(trace, pol)
    qpos = res.query_positions
    assert tab.tau.tolist() == sorted(set(qpos.tolist()))  # one event per decode query
    assert (tab.ev_stream == 2**31 + tab.tau).all()
    for e, t in enumerate(tab.tau):
        for g in range(trace.n_kv_heads):
            pi = tab.pi[e, g]
            assert (pi[t:] == 1).all() and (pi[:4] == 1).all() and (pi[t - 8:t] == 1).all()
            # expected kept tokens before t = the step's budget (a share of its own cache)
            assert pi[:t].sum() == pytest.approx(tab.budget_tokens[e, g], abs=1e-9)
            assert tab.budget_tokens[e, g] == pol.budget.tokens(int(t))
    assert not np.array_equal(tab.pi[0], tab.pi[-1])  # not nested, not fixed at prefill


def test_horvitz_thompson_totals_by_exact_enumeration_at_one_step():
    # A ~21-token cache, the design at one decode step: enumerate all 2^n tail samples.
    tr = synthetic_trace(3, n_heads=2, n_kv=1, d=4, P=24, prompt_length=20)
    pol = make_policy("perstep", "poisson", 10, schedule="step",
                      design_params={"mixture": 0.2},
                      score_params={"proxy": "quant:2", "window": 4, "sinks": 4,
                                    "top_fraction": 0.0})
    _, tab = _step_tables(tr, pol)
    e = 1
    t = int(tab.tau[e])
    pi = tab.pi[e, 0, :t]
    tail = np.flatnonzero(pi < 1)
    n = tail.size
    assert 8 <= n <= 20
    qi = int(np.flatnonzero(tr.query_positions == t)[0])
    s = tr.keys[0, :t] @ tr.queries[0, qi] * tr.scale
    y = np.exp(s - s.max())  # the denominator's population values
    yv = y[:, None] * tr.values[0, :t]  # the numerator's
    p = pi[tail]
    mean_d, mean_n, second_d = 0.0, np.zeros(tr.values.shape[2]), 0.0
    for bits in itertools.product((0, 1), repeat=n):
        k = np.array(bits, dtype=bool)
        prob = np.prod(np.where(k, p, 1 - p))
        ht_d = (y[tail][k] / p[k]).sum()
        mean_d += prob * ht_d
        mean_n += prob * (yv[tail][k] / p[k, None]).sum(axis=0)
        second_d += prob * ht_d**2
    np.testing.assert_allclose(mean_d, y[tail].sum(), rtol=1e-12)
    np.testing.assert_allclose(mean_n, yv[tail].sum(axis=0), rtol=1e-10, atol=1e-14)
    # The Poisson variance of the HT total: sum (1 - pi) / pi y^2.
    np.testing.assert_allclose(second_d - mean_d**2, ((1 - p) / p * y[tail] ** 2).sum(),
                               rtol=1e-9)


def test_fresh_uniforms_are_independent_across_steps_and_permanent_ones_are_shared(trace):
    fresh = make_policy("perstep", "poisson", 0.3, schedule="step", score_params={"window": 8})
    perm = make_policy("perstep", "poisson", 0.3, schedule="step:permanent",
                       score_params={"window": 8})
    _, tf = _step_tables(trace, fresh)
    _, tp = _step_tables(trace, perm)
    S = 4000
    u0 = seed_uniforms(np.arange(S), 0, trace.n_kv_heads, trace.n_positions)[:, 0]
    a, b = 0, tf.tau.size - 1
    ta = int(tf.tau[a])
    ka = np.stack([event_uniforms(tf, a, s, 0, 0, u0[s]) < tf.pi[a, 0] for s in range(S)])
    kb = np.stack([event_uniforms(tf, b, s, 0, 0, u0[s]) < tf.pi[b, 0] for s in range(S)])
    # Monte Carlo: inclusion frequencies are pi (4 standard errors), at both steps.
    for k, pi in ((ka, tf.pi[a, 0]), (kb, tf.pi[b, 0])):
        se = np.sqrt(pi * (1 - pi) / S) + 1e-12
        assert (np.abs(k.mean(axis=0) - pi) <= 4 * se + 1e-9).all()
    # Independent steps: joint inclusion = product of the pi (checked on pooled tail tokens).
    both = (ka[:, :ta] & kb[:, :ta]).mean(axis=0)
    prod = tf.pi[a, 0, :ta] * tf.pi[b, 0, :ta]
    mid = (prod > 0.05) & (prod < 0.95)
    assert mid.sum() >= 5
    assert np.abs(both[mid] - prod[mid]).max() < 0.05
    # Permanent: the same uniforms at every step, so joint inclusion = min(pi_a, pi_b).
    assert (tp.ev_stream == -1).all()
    pa, pb = tp.pi[a, 0, :ta], tp.pi[b, 0, :ta]
    joint = ((u0[:, :ta] < pa) & (u0[:, :ta] < pb)).mean(axis=0)
    assert np.abs(joint - np.minimum(pa, pb)).max() < 0.05


@pytest.mark.parametrize("spec", PROXY_SPECS)
def test_full_budget_gives_zero_error_for_every_proxy(trace, spec):
    pols = [make_policy("perstep", d, 1.0, schedule=sch, score_params={"proxy": spec,
                                                                       "window": 8})
            for d in ("poisson", "topk") for sch in ("step", "step:permanent")]
    res = replay_layer(trace, pols, np.arange(2), n_layers=2)
    from tracesim.kernels.replay import F_ERR2

    assert np.abs(res.out[..., F_ERR2]).max() < 1e-20


def test_per_step_results_are_bit_identical_across_threads(trace):
    pols = [make_policy("perstep", "poisson", 0.3, schedule=s, score_params={"proxy": p,
                                                                             "window": 8})
            for p in ("quant:2", "simhash:4,32") for s in ("step", "step:permanent")]
    assert_same_on_one_and_two_threads(trace, pols, np.array([3, 1, 4]))


def test_perstep_table_compares_each_design_with_top_k_by_its_proxy(tmp_path):
    from tracesim.analysis.perstep import perstep_table

    from tests.replay_fixtures import build_store
    from tracesim.replay import replay
    from tracesim.store import open_store

    store = open_store(build_store(tmp_path / "store", n_seqs=2, n_layers=1))
    pols = [make_policy("perstep", d, 0.4, schedule="step", score_params={"proxy": p,
                                                                          "window": 8})
            for p in ("exact", "quant:2") for d in ("topk", "poisson")]
    df = replay(store, pols, seeds=4, progress=False).to_pandas()
    table = perstep_table(df, head_dim=8)
    assert len(table) == 4 and set(table.proxy) == {"exact", "quant:2"}
    assert (table[table.design == "topk"].mse_vs_topk == 1).all()
    rnd = table[table.design == "poisson"]
    assert rnd.wald.between(0, 1).all() and rnd.mse_vs_topk.notna().all()
    assert table[table.design == "topk"].wald.isna().all()  # uncertified: no coverage
    assert (table.proxy_bits == [128, 128, 8 * 3, 8 * 3]).all()


def test_by_table_keeps_each_store_apart(tmp_path):
    from tracesim.analysis.perstep import by_table, perstep_table

    from tests.replay_fixtures import build_store
    from tracesim.replay import replay
    from tracesim.store import open_store

    store = open_store(build_store(tmp_path / "store", n_seqs=2, n_layers=1))
    pols = [make_policy("perstep", d, 0.4, schedule="step", score_params={"proxy": "quant:2",
                                                                          "window": 8})
            for d in ("topk", "poisson")]
    df = replay(store, pols, seeds=3, progress=False).to_pandas()
    # Two "stores" whose errors differ by a factor 4: each part keeps its own top-k baseline.
    a, b = df.assign(store="a"), df.assign(store="b", err2=df["err2"] * 4)
    table = by_table(pd.concat([a, b], ignore_index=True), "store", head_dim=8)
    assert list(table.store) == ["a", "a", "b", "b"]
    alone = perstep_table(a, head_dim=8)
    assert np.allclose(table[table.store == "a"].mse_vs_topk, alone.mse_vs_topk)
    assert np.allclose(table[table.store == "b"].mse_vs_topk, alone.mse_vs_topk)
    assert np.allclose(table[table.store == "b"].mse.to_numpy(), 4 * alone.mse.to_numpy())
    assert "read_rows" in table.columns
    with pytest.raises(ValueError, match="--by 'nope'"):
        by_table(df, "nope")
    # The report lists several stores apart and pools them in the figure.
    from tracesim.analysis.perstep_figure import add_to_report

    class Report:
        tables: dict = {}
        figures: dict = {}

        def add_figure(self, name, made):
            self.figures[name] = made

    report = Report()
    add_to_report(report, pd.concat([a, b], ignore_index=True), head_dim=8)
    assert report.tables["per-step designs"].splitlines()[0].split()[0] == "store"
    assert "Pooled over 2 stores" in report.figures["perstep_frontier"][1]


def _frame(config, n_seq, cov, err2, cert2=1.0, rng=None, **meta):
    rows = []
    for s in range(n_seq):
        for r in range(50):
            rows.append({"config_id": config, "sequence_id": f"s{s}",
                         "wald_cov": (float(r < (cov + 0.02 * (s % 2 - 0.5)) * 50)
                                      if cov is not None else np.nan),
                         "err2": err2 * rng.exponential(), "cert2": cert2,
                         "certified": cov is not None, **meta})
    return rows


def test_claims_c9_c10_and_the_conformal_radius_on_constructed_results():
    import pandas as pd
    from tracesim.analysis.perstep import conformal_radius, evaluate_c9, evaluate_c10
    from tracesim.analysis.prereg import load_prereg

    from tracesim.policies import make_policy

    pre = load_prereg("data/prereg.yaml")
    rng = np.random.default_rng(0)
    prim = make_policy("perstep", "poisson", 0.25, schedule="step",
                       design_params={"mixture": 0.1}, score_params={"proxy": "quant:4"})
    base = make_policy("perstep", "topk", 0.25, schedule="step",
                       score_params={"proxy": "quant:4"})
    for cov, ratio, verdict in ((0.95, 0.2, "supported"), (0.80, 0.2, "not supported"),
                                (0.95, 3.0, "not supported")):
        rows = (_frame(prim.id, 12, cov, ratio, rng=rng, **{k: prim.row()[k] for k in (
                    "score", "design", "budget", "correction", "mixture", "top_fraction",
                    "score_params")})
                + _frame(base.id, 12, None, 1.0, rng=rng, **{k: base.row()[k] for k in (
                    "score", "design", "budget", "correction", "mixture", "top_fraction",
                    "score_params")}))
        res = evaluate_c9(pd.DataFrame(rows), pre.claims["C9"], pre.claim_alpha("C9"))
        assert res["verdict"] == verdict, (cov, ratio, res)
    # C10: violation rates well below and well above delta = 0.25
    for rate, verdict in ((0.02, "supported"), (0.6, "not supported")):
        rows = []
        for want in pre.claims["C10"]["compare"]:
            label = "vattention(" + ",".join(f"{k}={want[k]:g}" for k in (
                "sinks", "local", "heavy", "base_rate", "epsilon", "delta")) + ")"
            for s in range(10):
                for j in range(100):
                    rows.append({"config_id": label, "sequence_id": f"s{s}", "kept_tokens": 9,
                                 "peer_bound_ok": float(j >= rate * 100 + (s % 2)),
                                 "peer_den_ok": 1.0})
        res = evaluate_c10(pd.DataFrame(rows), pre.claims["C10"], pre.claim_alpha("C10"))
        assert res["verdict"] == verdict
    # conformal radius: the ceil((n + 1) 0.95)-th smallest |err| / C
    cal = pd.DataFrame({"config_id": "c", "certified": True, "err2": np.arange(1, 20.0) ** 2,
                        "cert2": 1.0})
    assert conformal_radius(cal)["c"] == 19.0
    cal = pd.DataFrame({"config_id": "c", "certified": True, "err2": np.arange(1, 40.0) ** 2,
                        "cert2": 1.0})
    assert conformal_radius(cal)["c"] == 38.0


def test_cost_columns_follow_the_memory_model():
    import pandas as pd
    from tracesim.analysis.perstep import perstep_table
    from tracesim.analysis.perstep_costs import cost_columns

    from tracesim.tiers.model import MemoryModel, Tier

    step = make_policy("perstep", "poisson", 0.25, schedule="step",
                       score_params={"proxy": "quant:4"})
    pre = make_policy("snapkv", "poisson", 0.25)
    rows = []
    for pol, kept in ((step, 100), (pre, 90)):
        for h in range(4):  # 4 query heads, 2 KV heads (G = 2)
            rows.append({**pol.row(), "sequence_id": "s", "head": h, "kv_head": h // 2,
                         "kept_tokens": kept, "n_positions": 400, "wald_cov": 1.0,
                         "wald_t_cov": 1.0, "err2": 1.0, "cert2": 1.0})
    df = pd.DataFrame(rows)
    model = MemoryModel(lower=(Tier("dram", bandwidth_gbps=1.0, latency_us=2.0,
                                    capacity_gb=1.0, queue_depth=4),))
    t = cost_columns(perstep_table(df, 8), df, head_dim=8, model=model).set_index("score")
    b = 2 * 8 * 2  # bytes of one token of one KV head (fp16 K and V)
    # kept_tokens counts the step's cache [0, t): the current token is already out of it.
    rows_read = (100 - 4 - 32) * 2
    assert t.loc["perstep", "read_rows"] == rows_read
    assert t.loc["perstep", "hbm_kib"] == pytest.approx((36 * b + 400 * 8 * 5 / 8) * 2 / 1024)
    assert t.loc["snapkv", "hbm_kib"] == pytest.approx(90 * b * 2 / 1024)
    assert t.loc["snapkv", "read_rows"] == 0 and t.loc["snapkv", "step_us"] == 0
    waves = -(-rows_read // 4)
    assert t.loc["perstep", "step_us"] == pytest.approx(waves * 2.0 + rows_read * b / 1e3)
    partial = 2 * (2 * 8 + 3) * 4 * 2
    assert t.loc["perstep", "step_us_partial"] == pytest.approx(1 * 2.0 + partial / 1e3)


def test_frontier_counts_the_bytes_each_step_reads_and_draws():
    from tracesim.analysis.perstep import perstep_table
    from tracesim.analysis.perstep_costs import cost_columns
    from tracesim.analysis.perstep_figure import frontier_figure

    step = make_policy("perstep", "poisson", 0.25, schedule="step",
                       score_params={"proxy": "quant:4"})
    top = make_policy("perstep", "topk", 0.25, schedule="step", score_params={"proxy": "quant:4"})
    pre = make_policy("snapkv", "poisson", 0.25)
    rows = []
    for pol, kept, err in ((step, 100, 0.01), (top, 100, 0.1), (pre, 90, 1.0)):
        for h in range(4):  # 4 query heads, 2 KV heads
            rows.append({**pol.row(), "sequence_id": "s", "head": h, "kv_head": h // 2,
                         "kept_tokens": kept, "n_positions": 400, "err2": err,
                         "cert2": 1.0, "wald_cov": 1.0 if pol.certified else np.nan,
                         "wald_t_cov": 1.0 if pol.certified else np.nan})
    df = pd.DataFrame(rows)
    table = cost_columns(perstep_table(df, 8), df, head_dim=8)
    b = 2 * 8 * 2  # fp16 K and V of one token, d = 8
    got = table.set_index(["score", "design"])["step_read_kib"]
    # per-step: the attended tokens plus the 4-bit proxy of all 400 cached tokens (5 bits/d)
    assert got["perstep", "poisson"] == pytest.approx((100 * b + 400 * 8 * 5 / 8) * 2 / 1024)
    assert got["snapkv", "poisson"] == pytest.approx(90 * b * 2 / 1024)
    png, caption = frontier_figure(table)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and "HBM" in caption
    assert frontier_figure(table.assign(hbm_kib=np.nan)) is None


def test_frontier_md_tabulates_per_step_designs_against_their_costs(tmp_path):
    from tracesim.analysis.frontier_cli import perstep_costs_markdown, run_frontier

    from tests.replay_fixtures import build_store
    from tracesim.integrity import sign_results
    from tracesim.replay import replay
    from tracesim.store import open_store

    store = open_store(build_store(tmp_path / "store", n_seqs=2, n_layers=1))
    pols = [make_policy("perstep", "poisson", 0.4, schedule="step",
                        score_params={"proxy": "quant:4", "window": 8}),
            make_policy("snapkv", "poisson", 0.4, score_params={"window": 8})]
    df = replay(store, pols, seeds=2, progress=False)
    assert perstep_costs_markdown(df.to_pandas()[lambda d: d.score == "snapkv"]) == ""
    import pyarrow.parquet as pq

    pq.write_table(df, tmp_path / "results.parquet")
    sign_results(tmp_path / "results.parquet")
    run_frontier(tmp_path / "results.parquet", tmp_path / "front")
    md = (tmp_path / "front" / "frontier.md").read_text()
    section = md[md.index("## Per-step designs"):]
    assert "| perstep | quant:4 | poisson | step(fresh) |" in section
    assert "| snapkv | — | poisson | oneshot |" in section


def test_claims_need_two_sequences_and_paired_sequences():
    import pandas as pd
    from tracesim.analysis.cluster import one_sided_bounds
    from tracesim.analysis.perstep import evaluate_c9
    from tracesim.analysis.prereg import load_prereg

    m, lo, hi = one_sided_bounds(pd.Series([1.0, 0.0, 1.0, 1.0]), pd.Series(["a"] * 4), 0.95)
    assert m == 0.75 and np.isnan(lo) and np.isnan(hi)  # one sequence: no interval
    pre = load_prereg("data/prereg.yaml")
    prim = make_policy("perstep", "poisson", 0.25, schedule="step",
                       design_params={"mixture": 0.1}, score_params={"proxy": "quant:4"})
    base = make_policy("perstep", "topk", 0.25, schedule="step",
                       score_params={"proxy": "quant:4"})
    keys = ("score", "design", "budget", "correction", "mixture", "top_fraction", "score_params")
    rows = [{**{k: prim.row()[k] for k in keys}, "config_id": prim.id, "sequence_id": s,
             "wald_cov": 1.0, "err2": 0.1} for s in ("a", "b")]
    rows += [{**{k: base.row()[k] for k in keys}, "config_id": base.id, "sequence_id": "a",
              "wald_cov": np.nan, "err2": 1.0}]
    with pytest.raises(ValueError, match="different sequences"):
        evaluate_c9(pd.DataFrame(rows), pre.claims["C9"], pre.claim_alpha("C9"))
