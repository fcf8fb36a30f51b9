"""MagicPIG with independent hash sets as replicates: the replicate interval covers where the
Poisson-style one, blind to the shared hash, does not; one hash set is today's peer exactly."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import special

from tests.replay_fixtures import build_store, synthetic_trace
from tracesim.estimators import hajek_attention
from tracesim.peers import (
    MAX_REPLICATES,
    MagicPIG,
    StepInput,
    hajek_step_metrics,
    make_peer,
    replay_peers,
    replicate_hyperplanes,
    step_inputs,
)
from tracesim.proxies import hyperplanes

Z95 = float(special.ndtri(0.975))


def clustered_step(n_clusters: int = 4, noise: float = 0.05, n: int = 240, d: int = 8,
                   rng_seed: int = 3) -> StepInput:
    """One step whose keys sit in a few tight clusters: a shared hash keeps or drops a cluster
    together, so inclusions are strongly correlated (the whole cache is prefill)."""
    rng = np.random.default_rng(rng_seed)
    centres = rng.standard_normal((n_clusters, d))
    keys = centres[rng.integers(0, n_clusters, n)] + noise * rng.standard_normal((n, d))
    values = rng.standard_normal((n, d))
    query = rng.standard_normal(d)
    scale = 0.5
    logits = keys @ query * scale
    w = np.exp(logits - logits.max())
    return StepInput(layer=0, head=0, kv_head=0, step=n - 1, prompt_length=n, query=query,
                     keys=keys, values=values, scale=scale, logits=logits,
                     truth=w @ values / w.sum())


def test_replicate_interval_covers_where_the_poisson_one_does_not():
    # 2000 independent seeds, each R = 8 hash sets of its own. A draw's coverage is the share
    # of the d = 8 coordinates covered; its variance is at most that of one indicator, so the
    # Monte Carlo standard error of the mean is <= sqrt(0.95 * 0.05 / 2000) = 0.0049, and the
    # tolerance is 4 of those (0.0195). Measured: 0.953 (replicates), 0.814 (Poisson-style).
    x = clustered_step()
    peer = MagicPIG(bits=4, tables=16, sinks=2, local=2, replicates=8)
    draws = 2000
    rep_cov, poisson_cov = np.empty(draws), np.empty(draws)
    for seed in range(draws):
        row = peer.step(x, peer.prepare(0, 0, x.keys, x.prompt_length, seed), seed, Z95)
        rep_cov[seed], poisson_cov[seed] = row["rep_cov"], row["wald_cov"]
    tol = 4 * np.sqrt(0.95 * 0.05 / draws)
    assert abs(rep_cov.mean() - 0.95) <= tol, rep_cov.mean()
    assert poisson_cov.mean() < 0.95 - tol, poisson_cov.mean()


def test_one_hash_set_is_todays_peer_bit_for_bit():
    trace = synthetic_trace(5, n_heads=4, n_kv=2, d=8, P=160, prompt_length=140)
    assert MagicPIG(replicates=1).label() == MagicPIG().label()
    for k in range(3):  # replicate 0 is the single hash set of replicates = 1
        np.testing.assert_array_equal(replicate_hyperplanes(3, 1, 8, 36, k, 0),
                                      hyperplanes(3, 1, 8, 36, seed=k))
    assert not np.array_equal(replicate_hyperplanes(3, 1, 8, 36, 0, 1),
                              hyperplanes(3, 1, 8, 36, seed=0))
    peer = MagicPIG(bits=3, tables=12, sinks=4, local=16)
    lo, hi = 4, trace.prompt_length - 16
    for qi in np.flatnonzero(np.array(trace.query_roles) == "decode")[::3]:
        x = step_inputs(trace, 1, int(qi))
        g, seed = x.kv_head, 5
        row = peer.step(x, peer.prepare(trace.layer, g, trace.keys[g], trace.prompt_length,
                                        seed), seed, Z95)
        # The rule as it was written before replicates: one hash, then hajek_step_metrics.
        mu = trace.keys[g, lo:hi].mean(axis=0)
        W = hyperplanes(trace.layer, g, 8, 36, seed=seed)
        kc = x.keys[lo:hi] - mu
        hits = (((kc @ W) > 0).reshape(-1, 12, 3) == ((x.query @ W) > 0).reshape(12, 3)
                ).all(axis=2).sum(axis=1)
        cos = (kc @ x.query) / np.maximum(np.linalg.norm(kc, axis=1)
                                          * np.linalg.norm(x.query), 1e-300)
        p = 1 - np.arccos(np.clip(cos, -1, 1)) / np.pi
        c = p**3
        u = np.clip(1 - (1 - c) ** 12 - 12 * c * (1 - c) ** 11, 0, 1)
        pi, kept = np.ones(x.step + 1), np.ones(x.step + 1, dtype=bool)
        pi[lo:hi], kept[lo:hi] = np.minimum(1.0, u + 1e-4), hits >= 2
        ref = hajek_step_metrics(x, pi, kept, Z95)
        for key in ("err2", "cert2", "wald_cov", "tail_size", "n_eff"):
            assert row[key] == ref[key] or (np.isnan(row[key]) and np.isnan(ref[key])), key
        assert row["sampled"] == int((hits >= 2).sum())
        assert row["replicates"] == 1 and row["rows_read"] == row["kept_tokens"]
        assert "rep_cert2" not in row  # NaN in the table


def test_replicate_columns_match_a_loop_over_hash_sets():
    x = clustered_step(n_clusters=6, noise=0.3, n=120)
    R, seed = 5, 11
    peer = MagicPIG(bits=3, tables=10, sinks=4, local=8, replicates=R)
    row, out, attended = peer.attend(x, peer.prepare(2, 0, x.keys, x.prompt_length, seed),
                                     seed, Z95)
    lo, hi = 4, x.prompt_length - 8
    mu = x.keys[lo:hi].mean(axis=0)
    kc = x.keys[lo:hi] - mu
    single = MagicPIG(bits=3, tables=10, sinks=4, local=8)
    ests, variances, rows, union = [], [], 0, np.zeros(hi - lo, dtype=bool)
    for r in range(R):
        W = replicate_hyperplanes(2, 0, 8, 30, seed, r)
        st = (lo, hi, mu, ((W, single._codes(kc @ W)),), np.linalg.norm(kc, axis=1))
        one, _, kept = single.attend(x, st, seed, Z95)
        pi = np.ones(x.step + 1)
        cos = (kc @ x.query) / (np.linalg.norm(kc, axis=1) * np.linalg.norm(x.query))
        p = (1 - np.arccos(np.clip(cos, -1, 1)) / np.pi) ** 3
        pi[lo:hi] = np.minimum(1, 1 - (1 - p) ** 10 - 10 * p * (1 - p) ** 9 + 1e-4)
        est = hajek_attention(x.query, x.keys, x.values, pi, kept, scale=x.scale)
        np.testing.assert_allclose(est.estimate, one["estimate"], rtol=1e-12)
        ests.append(one["estimate"])
        variances.append(est.variance_diag)
        rows += int(kept.sum())
        union |= kept[lo:hi]
    ests = np.array(ests)
    mean = ests.mean(axis=0)
    s2 = ests.var(axis=0, ddof=1) / R
    t = float(special.stdtrit(R - 1, 0.975))
    err = mean - x.truth
    np.testing.assert_allclose(out, mean, rtol=1e-12)
    assert row["err2"] == pytest.approx(err @ err, rel=1e-12)
    assert row["rep_cert2"] == pytest.approx(s2.sum(), rel=1e-12)
    assert row["rep_cov"] == np.mean(np.abs(err) <= t * np.sqrt(s2))
    pv = np.sum(variances, axis=0) / R**2
    assert row["cert2"] == pytest.approx(pv.sum(), rel=1e-12)
    assert row["wald_cov"] == np.mean(np.abs(err) <= Z95 * np.sqrt(pv))
    assert row["replicates"] == R and row["rows_read"] == rows
    assert row["sampled"] == union.sum() and row["kept_tokens"] == attended.sum()
    assert attended[lo:hi].tolist() == union.tolist()


@pytest.mark.parametrize("value", [0, -1, 2.0, "4", True, None, MAX_REPLICATES + 1])
def test_bad_replicates_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="replicates"):
        make_peer("magicpig", replicates=value)


def test_replay_with_replicates_writes_both_certificates(tmp_path):
    from tracesim.store import open_store

    store = open_store(build_store(tmp_path / "s", n_seqs=1, n_layers=1))
    df = replay_peers(store, [MagicPIG(bits=2, tables=6, local=8, replicates=3),
                              MagicPIG(bits=2, tables=6, local=8)], [0]).to_pandas()
    rep = df[df.config_id.str.contains("replicates=3")]
    one = df[~df.config_id.str.contains("replicates")]
    assert len(rep) == len(one) > 0 and (rep.replicates == 3).all() and (one.replicates == 1).all()
    assert rep.rep_cov.between(0, 1).all() and rep.wald_cov.between(0, 1).all()
    assert (rep.rep_cert2 >= 0).all() and one.rep_cert2.isna().all()
    assert (rep.rows_read >= rep.kept_tokens).all() and (one.rows_read == one.kept_tokens).all()


def test_in_loop_summary_bits_count_every_hash_set():
    """The in-loop memory figure charges R sets of K·L hash bits (plus one 16-bit key norm)."""
    pytest.importorskip("torch")
    from tracesim.capture.inloop.peers import summary_bits

    one, four = MagicPIG(bits=10, tables=150), MagicPIG(bits=10, tables=150, replicates=4)
    assert summary_bits(one, 64) == 10 * 150 + 16
    assert summary_bits(four, 64) == 4 * 10 * 150 + 16
