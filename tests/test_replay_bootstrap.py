"""The replay's Poisson bootstrap (``ReplayOptions.bootstrap``): reference, coverage, options."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from scipy import stats

from tests.replay_fixtures import synthetic_trace
from tests.replay_reference import reference_replay
from tracesim import bootstrap_certificate, hajek_attention
from tracesim.kernels import replay as K
from tracesim.kernels import replay_bootstrap as KB
from tracesim.policies import make_policy
from tracesim.prn import bootstrap_count, bootstrap_weights
from tracesim.replay import BOOTSTRAP_COLUMNS, RESULT_COLUMNS, ReplayOptions, replay_layer
from tracesim.replay.inclusion import event_uniforms, seed_uniforms
from tracesim.replay.results import layer_batch

SMALL = {"window": 8}
N_BOOT = 24


def _policies():
    sp = SMALL
    return [
        make_policy("snapkv", "topk", 0.3, score_params=sp),  # uncertified: nulls
        make_policy("snapkv", "poisson", 0.3, score_params=sp, design_params={"mixture": 0.1}),
        make_policy("h2o", "bernoulli", 0.4, score_params={**sp, "normalize": True}),
        make_policy("knorm", "fixed", 0.3, score_params=sp),
        make_policy("streaming", "poisson", 0.3, schedule="decode:4"),
        make_policy("random", "bernoulli", 0.3, correction="hajek"),
        make_policy("perstep", "poisson", 0.3, schedule="step", design_params={"mixture": 0.1},
                    score_params={**sp, "proxy": "exact"}),
    ]


@pytest.fixture(scope="module")
def boot_run():
    trace = synthetic_trace(3)
    policies = _policies()
    seeds = np.array([0, 7])
    res = replay_layer(trace, policies, seeds, n_layers=4,
                       options=ReplayOptions(bootstrap=N_BOOT))
    return trace, policies, seeds, res


def _reference_boot(trace, policies, seeds, tables, out, n_boot, alpha=0.05):
    """``(boot_cov, boot_cert2)`` per (iteration, head, query) from
    :func:`tracesim.bootstrap_certificate` fed the documented Poisson(1) multipliers."""
    qidx = np.flatnonzero(np.isin(trace.query_roles, ["decode"]))
    qpos = trace.query_positions[qidx]
    H, G = trace.n_heads, trace.group_size
    u = seed_uniforms(seeds, trace.layer, trace.n_kv_heads, trace.n_positions)
    z = stats.norm.ppf(1 - alpha / 2)
    n_it = tables.it_cfg.size
    cov = np.full((n_it, H, qidx.size), np.nan)
    cert2 = np.full((n_it, H, qidx.size), np.nan)
    for it in range(n_it):
        if not policies[tables.it_cfg[it]].certified:
            continue
        slot, s, ks = tables.it_slot[it], tables.it_seed[it], tables.it_kslot[it]
        qev = tables.query_event(slot)
        for a, (qi, t) in enumerate(zip(qidx, qpos, strict=True)):
            e = qev[a]
            stream = max(int(tables.ev_stream[e]), 0)
            for h in range(H):
                g = h // G
                u_e = event_uniforms(tables, e, int(seeds[s]), trace.layer, g, u[s, g])
                kept = (tables.kmask[ks, g] > 0) if ks >= 0 else (u_e < tables.pi[e, g])
                vis = slice(0, t + 1)
                args = (trace.queries[h, qi], trace.keys[g, vis], trace.values[g, vis],
                        tables.pi[e, g, vis], kept[vis])
                weights = bootstrap_weights(int(seeds[s]), trace.layer, g, np.arange(t + 1),
                                            n_boot, pi=tables.pi[e, g, vis],
                                            sample_stream=stream)
                var = bootstrap_certificate(*args, scale=trace.scale, replicate_weights=weights,
                                            per_coordinate=True)
                est = hajek_attention(*args, scale=trace.scale).estimate
                p = np.exp(trace.keys[g, vis] @ trace.queries[h, qi] * trace.scale
                           - (trace.keys[g, vis] @ trace.queries[h, qi] * trace.scale).max())
                truth = p @ trace.values[g, vis] / p.sum()
                cert2[it, h, a] = var.sum()
                if not np.isnan(out[it, h, a, K.F_WALD]):
                    cov[it, h, a] = np.mean(np.abs(est - truth) <= z * np.sqrt(var))
    return cov, cert2


def test_bootstrap_columns_match_the_python_reference(boot_run):
    trace, policies, seeds, res = boot_run
    cov, cert2 = _reference_boot(trace, policies, seeds, res.tables, res.out, N_BOOT)
    got_cov, got_cert2 = res.boot[..., KB.B_COV], res.boot[..., KB.B_CERT2]
    np.testing.assert_array_equal(np.isnan(got_cert2), np.isnan(cert2))
    np.testing.assert_array_equal(np.isnan(got_cov), np.isnan(cov))
    ok = ~np.isnan(cert2)
    assert ok.sum() > 100 and (cert2[ok] > 0).mean() > 0.9
    np.testing.assert_allclose(got_cert2[ok], cert2[ok], rtol=1e-10, atol=1e-14)
    okc = ~np.isnan(cov)
    assert np.abs(got_cov[okc] - cov[okc]).max() == 0.0
    # Uncertified policies (top-k) get nulls.
    topk = res.tables.it_cfg == 0
    assert np.isnan(res.boot[topk]).all()


def test_bootstrap_off_leaves_every_field_and_column_unchanged(boot_run):
    trace, policies, seeds, res = boot_run
    plain = replay_layer(trace, policies, seeds, n_layers=4)
    assert plain.boot is None
    np.testing.assert_array_equal(plain.out, res.out)
    np.testing.assert_array_equal(plain.lout, res.lout)
    off = layer_batch(plain)
    on = layer_batch(res)
    assert off.schema.names == list(RESULT_COLUMNS)
    assert on.schema.names == list(RESULT_COLUMNS) + list(BOOTSTRAP_COLUMNS)
    assert on.select(list(RESULT_COLUMNS)).equals(off)
    # Aggregated rows: means over seeds; nulls where uncertified.
    boot_cov = on.column("boot_cov").to_numpy(zero_copy_only=False)
    assert np.isfinite(boot_cov).any() and np.isnan(boot_cov).any()


def test_bootstrap_reference_agreement_in_output_reference(boot_run):
    # The engine's other fields under bootstrap are the plain-numpy reference's (unchanged).
    trace, policies, seeds, res = boot_run
    out, _ = reference_replay(trace, policies, seeds, res.tables)
    ok = ~np.isnan(out[..., K.F_WALD])
    np.testing.assert_array_equal(np.isnan(res.out[..., K.F_WALD]), ~ok)


def test_poisson_multipliers_are_poisson_one_and_keyed():
    w = bootstrap_weights(3, 1, 0, np.arange(4000), 50)
    assert w.shape == (50, 4000) and (w == np.round(w)).all() and w.min() == 0
    counts = np.bincount(w.astype(int).ravel(), minlength=6)[:6] / w.size
    pmf = stats.poisson.pmf(np.arange(6), 1.0)
    assert np.abs(counts - pmf).max() < 5 * np.sqrt(pmf * (1 - pmf) / w.size).max()
    # The scalar kernel reads the same key; another replicate, stream or seed differs.
    assert bootstrap_count(3, 1, 0, 17, 5, 0, 0.0) == w[5, 17]
    other = bootstrap_weights(3, 1, 0, np.arange(4000), 50, sample_stream=2**31 + 9)
    assert (other != w).mean() > 0.5
    assert (bootstrap_weights(4, 1, 0, np.arange(4000), 50) != w).mean() > 0.5


@pytest.mark.parametrize("pi", [0.1, 0.5, 0.9])
def test_multipliers_have_the_poisson_designs_variance(pi):
    """With the token's pi the multiplier is 1 with probability pi, else Poisson(1): mean 1 and
    variance 1 - pi (the design's, as DESIGN's Gamma(1/(1-pi), 1-pi) multipliers)."""
    w = bootstrap_weights(3, 1, 0, np.arange(4000), 50, pi=np.full(4000, pi))
    n = w.size
    assert abs(w.mean() - 1.0) < 5 * np.sqrt((1 - pi) / n)
    assert abs(w.var() - (1 - pi)) < 0.03
    assert bootstrap_count(3, 1, 0, 17, 5, 0, pi) == w[5, 17]
    assert (bootstrap_weights(3, 1, 0, np.arange(10), 4, pi=np.ones(10)) == 1.0).all()


def test_bootstrap_coverage_is_near_nominal_on_a_synthetic_population():
    """Monte Carlo over 100 seeds: the bootstrap interval covers as the Wald one does.

    A flat-attention population (queries scaled down) and a Poisson design with tails of about
    90 tokens, where the linearisation is fair; seeds are independent, so the standard error
    of the mean coverage comes from the per-seed means.
    """
    trace = synthetic_trace(11, P=340, prompt_length=320, o_proj=False)
    trace = dataclasses.replace(trace, queries=trace.queries * 0.25, outputs=None)
    policy = make_policy("random", "poisson", 0.3, correction="hajek")
    seeds = np.arange(100)
    res = replay_layer(trace, [policy], seeds, n_layers=1,
                       options=ReplayOptions(bootstrap=200, output_space=False))
    assert np.nanmean(res.out[..., K.F_TAIL]) > 60
    per_seed = np.nanmean(res.boot[..., KB.B_COV].reshape(seeds.size, -1), axis=1)
    wald = np.nanmean(res.out[..., K.F_WALD].reshape(seeds.size, -1), axis=1)
    mean, se = per_seed.mean(), per_seed.std(ddof=1) / np.sqrt(seeds.size)
    diff = per_seed - wald
    se_diff = diff.std(ddof=1) / np.sqrt(seeds.size)
    # A design-based variance of the same estimate: it covers as Wald does (both share the
    # linearisation's small undercoverage here), and near the nominal level.
    assert abs(diff.mean()) < 4 * se_diff + 0.005, (mean, wald.mean(), se_diff)
    assert 0.88 < mean < 0.97, (mean, se)
    # The multipliers carry the design's variance 1 - pi: on average the bootstrap variance is
    # the linearised one's (no 1 / (1 - pi) inflation).
    ratio = np.nanmean(res.boot[..., KB.B_CERT2]) / np.nanmean(res.out[..., K.F_CERT2])
    assert 0.85 < ratio < 1.15, ratio


@pytest.mark.parametrize("bad", [1, -1, 2.5, True, "200", 10**6])
def test_bad_replicate_counts_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="ReplayOptions.bootstrap"):
        ReplayOptions(bootstrap=bad)


def test_sweep_spec_bootstrap_option():
    from tracesim.policies.grid import SpecError
    from tracesim.sweep.fields import _options

    assert _options({"bootstrap": 200}, "spec: options").bootstrap == 200
    assert _options(None, "spec: options").bootstrap == 0
    for bad in (1, -3, 1.5, False, "x"):
        with pytest.raises(SpecError, match=r"options\.bootstrap"):
            _options({"bootstrap": bad}, "spec: options")


def test_frontier_reports_the_bootstrap_variant():
    from tracesim.analysis.frontier import frontier_table

    from tests.frontier_fixtures import synthetic_results

    df = synthetic_results(n_seq=6, seeds=2)
    table, notes = frontier_table(df)
    assert "bootstrap" not in set(table["variant"])
    df["boot_cov"] = np.where(df["certified"], df["wald_cov"], np.nan)
    table, notes = frontier_table(df)
    assert "bootstrap" in set(table["variant"])
    assert not any("boot_cov" in n for n in notes)
    boot = table[(table["variant"] == "bootstrap") & (table["stratum_kind"] == "all")]
    wald = table[(table["variant"] == "wald") & (table["stratum_kind"] == "all")]
    np.testing.assert_allclose(boot["coverage"].to_numpy(), wald["coverage"].to_numpy())


def test_sweep_with_bootstrap_is_identical_on_one_and_two_workers(tmp_path):
    import pandas as pd
    import pyarrow.parquet as pq
    import yaml

    from tests.sweep_fixtures import SPEC_TEXT, build_sweep_store
    from tracesim.sweep import load_spec, run_sweep

    build_sweep_store(tmp_path / "store")
    (tmp_path / "prereg.yaml").write_text("version: 1\n")
    doc = yaml.safe_load(SPEC_TEXT)
    doc["prereg"] = "prereg.yaml"
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump(doc, sort_keys=False))
    doc["options"] = {**(doc.get("options") or {}), "bootstrap": 16}
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    # The option is part of the result hash only when on.
    assert load_spec(spec).result_hash() != load_spec(plain).result_hash()
    keys = ["store", "sequence_id", "layer", "config_id", "head", "query_index", "seed"]
    frames = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        summary = run_sweep(spec, workers=workers, threads_per_worker=1, out=out,
                            progress=False)
        assert summary.complete
        df = pq.read_table(out / "results" / "parts").to_pandas()
        frames.append(df.sort_values(keys).reset_index(drop=True))
    assert {"boot_cov", "boot_cert2"} <= set(frames[0].columns)
    assert frames[0]["boot_cov"].notna().any()
    pd.testing.assert_frame_equal(frames[0], frames[1], check_exact=True)


def test_bootstrap_is_independent_of_the_query_chunking(boot_run, monkeypatch):
    from tracesim.replay import engine

    trace, policies, seeds, res = boot_run
    monkeypatch.setattr(engine, "LOGIT_BUDGET_BYTES", trace.n_heads * trace.n_positions * 8 * 3)
    assert engine.query_chunk(trace.n_heads, res.query_index.size, trace.n_positions) == 3
    chunked = replay_layer(trace, policies, seeds, n_layers=4,
                           options=ReplayOptions(bootstrap=N_BOOT))
    np.testing.assert_array_equal(chunked.boot, res.boot)


@pytest.mark.parametrize("bad", ["1", "-2", "100001"])
def test_replay_cli_refuses_a_bad_bootstrap_naming_the_option(tmp_path, capsys, bad):
    from tracesim.app.cli import main

    code = main(["replay", str(tmp_path / "store"), "--bootstrap", bad, "--out",
                 str(tmp_path / "out")])
    assert code == 2 and "--bootstrap" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
