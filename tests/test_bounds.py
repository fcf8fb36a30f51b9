"""The page-summary bound: never below the true error, on every row and every draw.

Checked against brute force (summaries, logit bounds), exact enumeration over all 2^n Poisson
samples, adversarial heads (a huge-logit spike inside a page, huge values), the compiled kernel
against the numpy reference, and the replay engine on synthetic traces and the sample store.
"""

from dataclasses import replace

import numpy as np
import pytest

from tracesim.bounds import (
    attention_error_bound,
    build_page_summaries,
    logit_lower_bounds,
    logit_upper_bounds,
    ratio_box_max,
    summary_tokens,
)
from tracesim.kernels import bounds as KB
from tracesim.kernels import replay as K
from tracesim.policies import Policy, make_policy
from tracesim.replay import replay_layer
from tracesim.replay.engine import ReplayOptions

from .replay_fixtures import synthetic_trace

OPTS = ReplayOptions(output_space=False)


def _attention(q, keys, values, scale):
    s = keys @ q * scale
    w = np.exp(s - s.max())
    return w @ values / w.sum()


def test_summaries_match_brute_force_and_bound_every_logit():
    rng = np.random.default_rng(0)
    keys, values = rng.normal(size=(50, 5)), rng.normal(size=(50, 5))
    missing = rng.random(50) < 0.6
    s = build_page_summaries(keys, values, missing, 8)
    pages = np.unique(np.flatnonzero(missing) // 8)
    assert s.n_pages == pages.size
    for b, pg in enumerate(pages):
        idx = np.flatnonzero(missing & (np.arange(50) // 8 == pg))
        np.testing.assert_array_equal(s.kmin[b], keys[idx].min(0))
        np.testing.assert_array_equal(s.kmax[b], keys[idx].max(0))
        np.testing.assert_allclose(s.vcen[b], values[idx].mean(0))
        assert s.vrad[b] == pytest.approx(np.linalg.norm(values[idx] - s.vcen[b], axis=1).max())
        assert (s.count[b], s.first[b], s.last[b]) == (idx.size, idx[0], idx[-1])
    for _ in range(20):
        q = rng.normal(size=5) * 3
        up, lo = logit_upper_bounds(q, s, 0.5), logit_lower_bounds(q, s, 0.5)
        for b, pg in enumerate(pages):
            idx = np.flatnonzero(missing & (np.arange(50) // 8 == pg))
            logits = 0.5 * keys[idx] @ q
            assert (logits <= up[b] + 1e-12).all() and (logits >= lo[b] - 1e-12).all()
    # Memory: (3d + 3) numbers per page, a token is 2d numbers.
    assert summary_tokens(s) == pytest.approx(s.n_pages * 18 / 10)


def test_low_rank_basis_bounds_every_logit():
    rng = np.random.default_rng(1)
    keys, values = rng.normal(size=(40, 6)), rng.normal(size=(40, 6))
    basis = np.linalg.qr(rng.normal(size=(6, 2)))[0]
    s = build_page_summaries(keys, values, np.ones(40, bool), 10, basis=basis)
    for _ in range(20):
        q = rng.normal(size=6)
        up, lo = logit_upper_bounds(q, s, 1.0), logit_lower_bounds(q, s, 1.0)
        logits = (keys @ q).reshape(4, 10)
        assert (logits.max(1) <= up + 1e-12).all() and (logits.min(1) >= lo - 1e-12).all()


@pytest.mark.parametrize("page", [0, -3, 2.5, True])
def test_bad_page_size_is_an_error_naming_the_field(page):
    with pytest.raises(ValueError, match="summary_page"):
        build_page_summaries(np.zeros((4, 2)), np.zeros((4, 2)), np.ones(4, bool), page)


def test_policy_rejects_negative_page_and_keeps_ids_stable():
    with pytest.raises(ValueError, match="summary_page"):
        make_policy("snapkv", "topk", 0.25, summary_page=-1)
    plain = make_policy("snapkv", "topk", 0.25)
    paged = make_policy("snapkv", "topk", 0.25, summary_page=16)
    assert "pages" not in plain.id and paged.id == plain.id + "|pages=16"
    assert "summary_page" not in plain.to_json()
    import json
    again = Policy.from_dict(json.loads(paged.to_json()))
    assert again.id == paged.id and again.row()["summary_page"] == 16


def test_ratio_box_max_is_the_vertex_maximum():
    rng = np.random.default_rng(2)
    for _ in range(200):
        n = int(rng.integers(1, 7))
        D, width = rng.exponential(size=n), rng.exponential(size=n)
        num0, den0 = rng.exponential(), rng.exponential()
        verts = ((np.arange(2**n)[:, None] >> np.arange(n)) & 1) * width
        brute = ((num0 + verts @ D) / (den0 + verts.sum(1))).max()
        assert ratio_box_max(num0, den0, D, width) == pytest.approx(brute, rel=1e-12)


def _adversarial_head(rng, kind, N=64, d=8):
    keys = rng.normal(size=(N, d))
    values = rng.normal(size=(N, d))
    q = rng.normal(size=d)
    if kind == "spike":  # one token inside a page gets a logit ~ +60 over the rest
        i = int(rng.integers(N))
        keys[i] = q * 60.0 / (q @ q)
    elif kind == "huge_values":
        values[rng.integers(N, size=3)] *= 1e6
    elif kind == "huge_logits":
        keys *= 40.0
    elif kind == "extreme_spike":  # kept weights underflow against the spike's page bound
        keys[int(rng.integers(N))] = q * 1000.0 / (q @ q)
    return q, keys, values


KINDS = ["plain", "spike", "huge_values", "huge_logits", "extreme_spike"]


@pytest.mark.parametrize("kind", KINDS)
def test_bound_holds_on_adversarial_heads(kind):
    rng = np.random.default_rng(KINDS.index(kind))
    for trial in range(150):
        q, keys, values = _adversarial_head(rng, kind)
        kept = rng.random(keys.shape[0]) < rng.uniform(0.05, 0.9)
        page = int(rng.choice([1, 4, 16, 64]))
        s = build_page_summaries(keys, values, ~kept, page)
        o = _attention(q, keys, values, 1.0)
        ests = [None, values[kept].mean(0) if kept.any() else values[0], np.zeros(8)]
        o_r = _attention(q, keys[kept], values[kept], 1.0) if kept.any() else None
        for est in ests:
            res = attention_error_bound(q, keys, values, kept, s, 1.0, estimate=est)
            if est is None and o_r is not None:  # o_R itself must be right, not just consistent
                np.testing.assert_allclose(res.kept_average, o_r, rtol=1e-9, atol=1e-12)
            o_hat = res.kept_average if est is None else est
            assert np.linalg.norm(o_hat - o) <= res.bound, (kind, trial, page)
            true_mass = _missing_mass(q, keys, kept)
            assert true_mass <= res.mass_bound * (1 + 1e-12) + 1e-300


def _missing_mass(q, keys, kept):
    s = keys @ q
    w = np.exp(s - s.max())
    return w[~kept].sum() / w.sum()


def test_spike_in_an_evicted_page_is_seen():
    """A huge logit hidden in an evicted page: the bound covers the full error."""
    rng = np.random.default_rng(5)
    q, keys, values = _adversarial_head(rng, "plain", N=64)
    keys[37] = q * 30 / (q @ q)  # logit 30, far above the rest
    values[37] = 50.0
    kept = np.ones(64, bool)
    kept[32:48] = False
    s = build_page_summaries(keys, values, ~kept, 16)
    res = attention_error_bound(q, keys, values, kept, s, 1.0)
    err = np.linalg.norm(res.kept_average - _attention(q, keys, values, 1.0))
    assert err > 100 and err <= res.bound and res.mass_bound > 0.99


@pytest.mark.parametrize("n_tail", [5, 8])
def test_exact_enumeration_bound_never_below_error(n_tail):
    """Every one of the 2^n Poisson samples: Hájek, uncorrected and a foreign estimate."""
    from tracesim import inclusion_probabilities

    for seed in range(3):
        rng = np.random.default_rng(100 * n_tail + seed)
        N, d = n_tail + 3, 4
        keys, values, q = rng.normal(size=(N, d)) * 1.5, rng.normal(size=(N, d)), rng.normal(
            size=d)
        keys[3 + seed % n_tail] *= 4  # a spike in the tail
        s = keys @ q
        pi = np.ones(N)
        pi[3:] = inclusion_probabilities(np.exp(s[3:]), n_tail / 3, mixture=0.1)
        o = _attention(q, keys, values, 1.0)
        samples = (np.arange(2**n_tail)[:, None] >> np.arange(n_tail)) & 1
        for page in (1, 3, 8):
            for bits in samples:
                kept = np.r_[np.ones(3, bool), bits.astype(bool)]
                summ = build_page_summaries(keys, values, ~kept, page)
                w = np.exp(s - s.max())[kept] / pi[kept]
                hajek = w @ values[kept] / w.sum()
                for est in (None, hajek):
                    res = attention_error_bound(q, keys, values, kept, summ, 1.0, estimate=est)
                    o_hat = res.kept_average if est is None else est
                    assert np.linalg.norm(o_hat - o) <= res.bound


def _reference_rows(trace, policy, result, it_index, seed_u):
    """Numpy bound for every (head, query) of one iteration (one-shot schedule)."""
    tabs = result.tables
    slot = tabs.it_slot[it_index]
    e = tabs.slot_ev[slot]
    out = np.empty((trace.n_heads, result.query_index.size))
    for h in range(trace.n_heads):
        g = h // trace.group_size
        pi = tabs.pi[e, g]
        kept = seed_u[g] < pi
        for a, qi in enumerate(result.query_index):
            t = int(trace.query_positions[qi])
            summ = build_page_summaries(trace.keys[g, :t + 1], trace.values[g, :t + 1],
                                        ~kept[:t + 1], policy.summary_page)
            q = trace.queries[h, qi]
            s = trace.scale * trace.keys[g, :t + 1] @ q
            kk = np.flatnonzero(kept[:t + 1])
            w = np.exp(s[kk] - s[kk].max()) / (pi[kk] if policy.correction == "hajek" else 1)
            est = w @ trace.values[g, kk] / w.sum()
            out[h, a] = attention_error_bound(q, trace.keys[g, :t + 1], trace.values[g, :t + 1],
                                              kept[:t + 1], summ, trace.scale, estimate=est).bound
    return out


@pytest.mark.parametrize("design", ["topk", "poisson"])
def test_kernel_matches_numpy_reference_and_covers_every_seed(design):
    trace = synthetic_trace(3, P=96, prompt_length=80)
    policy = make_policy("snapkv", design, 0.4, summary_page=8, score_params={"window": 4})
    seeds = np.arange(12)
    res = replay_layer(trace, [policy], seeds, 1, OPTS)
    from tracesim.replay.inclusion import seed_uniforms
    u = seed_uniforms(seeds, 0, trace.n_kv_heads, trace.n_positions)
    for it in range(res.tables.it_cfg.size):
        ref = _reference_rows(trace, policy, res, it, u[res.tables.it_seed[it]])
        np.testing.assert_allclose(res.bounds[it, ..., KB.B_BOUND], ref, rtol=1e-9)
    assert (res.out[..., K.F_ERR2] <= res.bounds[..., KB.B_BOUND] ** 2).all()
    assert (res.out[..., K.F_ERR2] > 0).any()


def test_monte_carlo_fixed_seeds_coverage_is_one_for_every_design():
    """Fixed-seed Monte Carlo: 64 draws x 3 synthetic layers x 4 designs, every row covered."""
    policies = [make_policy("snapkv", d, b, summary_page=p, score_params={"window": 4},
                            design_params={"mixture": 0.1} if d in ("poisson", "fixed") else None)
                for d in ("topk", "poisson", "bernoulli", "fixed")
                for b, p in ((0.2, 4), (0.5, 16))]
    for seed in range(3):
        trace = synthetic_trace(10 + seed)
        res = replay_layer(trace, policies, np.arange(64), 1, OPTS)
        b2 = res.bounds[..., KB.B_BOUND] ** 2
        assert np.isfinite(b2).all()
        assert (res.out[..., K.F_ERR2] <= b2).all()


def test_no_summaries_gives_nan_columns_and_decode_schedule_works():
    trace = synthetic_trace(4)
    plain = make_policy("h2o", "poisson", 0.3, schedule="decode:4", score_params={"window": 4})
    paged = make_policy("h2o", "poisson", 0.3, schedule="decode:4", summary_page=8,
                        score_params={"window": 4})
    res = replay_layer(trace, [plain, paged], np.arange(16), 1, OPTS)
    plain_rows = res.tables.it_cfg == 0
    assert np.isnan(res.bounds[plain_rows]).all()
    b2 = res.bounds[~plain_rows][..., KB.B_BOUND] ** 2
    assert (res.out[~plain_rows][..., K.F_ERR2] <= b2).all()
    none = replay_layer(trace, [plain], np.arange(2), 1, OPTS)
    assert none.bounds is None


def test_c0_perturbation_is_seen_by_the_bound():
    """C0 made quantitative: perturb what top-k evicts; its retained cache is bit-identical, the
    certificate cannot exist, but the bound from the retained summaries grows with t."""
    from tracesim.adversary import retained_hash

    trace = synthetic_trace(7)
    policy = make_policy("snapkv", "topk", 0.25, summary_page=16, score_params={"window": 4})
    base = replay_layer(trace, [policy], np.arange(1), 1, OPTS)
    g, head = 0, 0
    pi = base.tables.pi[0, g]
    evicted = np.flatnonzero(pi[:policy.score.compress_end(trace)] == 0)
    delta = np.random.default_rng(0).standard_normal(trace.values.shape[2])
    hashes, bounds, errs = [], [], []
    for t in (0.0, 1.0, 10.0, 100.0):
        values = trace.values.copy()
        values[g, evicted] += t * delta
        pert = replace(trace, values=values, outputs=None, _attention_cache={})
        res = replay_layer(pert, [policy], np.arange(1), 1, OPTS)
        L = policy.score.compress_end(pert)
        hashes.append(retained_hash(pert, g, res.tables.pi[0, g], policy.score.scores(pert, g, L)))
        bounds.append(res.bounds[0, head, :, KB.B_BOUND].mean())
        errs.append(np.sqrt(res.out[0, head, :, K.F_ERR2]).mean())
        assert (res.out[0, ..., K.F_ERR2] <= res.bounds[0, ..., KB.B_BOUND] ** 2).all()
    assert len(set(hashes)) == 1
    assert all(b2 > b1 for b1, b2 in zip(bounds, bounds[1:], strict=False)), bounds
    # The bound grows linearly in t like the error (both ~ t |delta| x missing weight).
    assert bounds[-1] / bounds[1] > 20 and errs[-1] / errs[1] > 20


SAMPLE = "data/sample-traces"


def test_every_row_of_the_sample_store_is_covered():
    """Real SmolLM2 traces (fp16 sample store): every layer, head, query, policy and seed."""
    from pathlib import Path

    from tracesim.replay import replay
    from tracesim.store import open_store

    root = Path(__file__).resolve().parents[1] / SAMPLE
    pols = [make_policy("snapkv", d, 0.5, summary_page=p, score_params={"window": 8},
                        design_params={"mixture": 0.1} if d == "poisson" else None)
            for d in ("topk", "poisson") for p in (4, 16)]
    table = replay(open_store(root), pols, seeds=4, per_seed=True, progress=False,
                   options=OPTS)
    cov = np.asarray(table.column("bound_cov"))
    assert cov.size > 10000 and (cov == 1.0).all()
    err2, bound2 = np.asarray(table.column("err2")), np.asarray(table.column("bound2"))
    assert (err2 <= bound2).all() and (err2 > 0).mean() > 0.9
    tokens = np.asarray(table.column("summary_tokens"))
    assert (tokens > 0).all() and np.isfinite(tokens).all()


def test_spec_grid_and_cli_take_summary_page(tmp_path, capsys):
    from tracesim.app.cli import main
    from tracesim.policies.grid import SpecError, parse_grid

    pols = parse_grid({"score": "snapkv", "design": "topk", "budget": 0.25,
                       "summary_page": [0, 16]})
    assert [p.summary_page for p in pols] == [0, 16]
    with pytest.raises(SpecError, match=r"grid.summary_page\[1\]"):
        parse_grid({"score": "snapkv", "design": "topk", "budget": 0.25,
                    "summary_page": [8, -1]})
    code = main(["replay", str(SAMPLE), "--summary-page", "-4", "--out", str(tmp_path)])
    assert code == 2 and "--summary-page: -4" in capsys.readouterr().err


def test_impossibility_demo_reports_a_growing_bound():
    from tracesim.adversary import impossibility_demo

    table = impossibility_demo(synthetic_trace(8), score="snapkv", budget=0.3, head=1, seeds=4,
                               grid=(0.0, 10.0, 1000.0), score_params={"window": 8},
                               summary_page=8)
    rows = table.to_pylist()
    assert all(r["topk_identical"] for r in rows)
    assert all(r["topk_bound2"] >= r["topk_err2"] for r in rows)
    assert rows[2]["topk_bound2"] > 1e3 * rows[1]["topk_bound2"] > 1e3 * rows[0]["topk_bound2"]
