"""The long-context benchmarks on a tiny synthetic layer: policy spellings, per-step replays,
and the cost columns against a hand count of the tokens each step reads."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from benchmarks import bench_long_context as blc
from benchmarks.bench_long_costs import cost_table
from tracesim.policies import make_policy
from tracesim.policies.base import take_all_mask
from tracesim.replay.kept import event_inclusion


def test_policy_spellings_parse():
    assert blc.split_policy_specs("snapkv:poisson, perstep:simhash:10,150:poisson,"
                                  "perstep:quant:4,16:topk,h2o:bernoulli") == [
        "snapkv:poisson", "perstep:simhash:10,150:poisson", "perstep:quant:4,16:topk",
        "h2o:bernoulli"]
    pre, step, sim = blc.parse_policies("snapkv:poisson,perstep:quant:4:poisson,"
                                        "perstep:simhash:10,150:poisson")
    # The prefill spelling is what it always was.
    assert pre.id == make_policy("snapkv", "poisson", 0.25).id
    assert step.id == make_policy("perstep", "poisson", 0.25, schedule="step",
                                  design_params={"mixture": 0.1},
                                  score_params={"proxy": "quant:4"}).id
    assert step.schedule.per_step and step.schedule.fresh
    assert step.design.mixture == 0.1 and step.budget.value == 0.25
    assert sim.score.proxy == "simhash:10,150"
    for bad in ("perstep:poisson", "snapkv", "snapkv:poisson:step"):
        with pytest.raises(ValueError, match="perstep:PROXY:DESIGN"):
            blc.policy_from_spec(bad)


def test_decode_queries_are_consecutive_steps_at_the_end():
    trace = blc.long_layer(300, n_decode=6)
    decode = [p for p, r in zip(trace.query_positions.tolist(), trace.query_roles,
                                strict=True) if r == "decode"]
    assert decode == list(range(294, 300)) and trace.prompt_length == 294


def test_per_step_spelling_runs_on_a_tiny_layer(capsys):
    out = blc.main(["--positions", "320", "--decode", "6", "--seeds", "2", "--policies",
                    "perstep:quant:4:poisson,snapkv:poisson", "--json"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["policies"] == 2 and printed["finite"]
    # one iteration per seed of each randomized policy
    assert printed["iterations"] == 4
    for key in ("peak_rss_mb", "rss_layer_built_mb", "rss_warm_mb"):
        assert math.isfinite(out[key]) and out[key] > 0


def test_rows_read_match_a_hand_count_of_each_step():
    P, n_decode = 300, 6
    table, _ = cost_table(P, n_decode, 1, "perstep:quant:4:poisson,snapkv:poisson")
    trace = blc.long_layer(P, n_decode=n_decode)
    pol = blc.policy_from_spec("perstep:quant:4:poisson")
    read = 0
    for t in range(P - n_decode, P):
        _, kept = event_inclusion(trace, pol, 0, 30, tau=t)
        assert kept[:, t].all()  # the step's own token is always kept (and in HBM)
        # read from the lower tier: kept tokens of [0, t) outside the sinks and the window
        read += int((kept[:, :t] & ~take_all_mask(t, 4, 32)).sum())
    per_step = table.set_index("score").loc["perstep"]
    assert per_step["read_rows"] == pytest.approx(read / n_decode, rel=1e-12)
    b = 2 * 64 * 2  # fp16 K and V of one token of one KV head, d = 64
    assert per_step["link_kib"] == pytest.approx(read / n_decode * b / 1024, rel=1e-12)
    pre = table.set_index("score").loc["snapkv"]
    assert pre["read_rows"] == 0 and pre["step_us"] == 0
    assert pre["hbm_kib"] == pytest.approx(pre["kept"] * 3 * b / 1024)
    assert np.isfinite(table["step_us"]).all()


def test_simhash_logits_do_not_depend_on_the_code_chunk(monkeypatch):
    from tests.replay_fixtures import synthetic_trace
    from tracesim.proxies import SimHashProxy
    from tracesim.proxies import simhash as sh

    trace = synthetic_trace(7, n_heads=4, n_kv=2, d=8, P=96, prompt_length=80)
    q = trace.queries[2:4, -1]
    proxy = SimHashProxy(bits=4, tables=32)
    whole = proxy.logits(trace, 1, q, 90)
    # the unchunked formula, written out
    mu, W, codes, norms = proxy._codes(trace, 1)
    # codes are packed 8 bits to a byte
    qc = ((q @ W) > 0).astype(float)
    c = np.unpackbits(codes, axis=1)[:90, :W.shape[1]].astype(float)
    agree = qc @ c.T + (1 - qc) @ (1 - c).T
    ref = (np.linalg.norm(q, axis=1)[:, None] * norms[None, :90]
           * np.cos(np.pi * (1 - agree / W.shape[1])) + (q @ mu)[:, None]) * trace.scale
    np.testing.assert_array_equal(whole, ref)
    for chunk_bytes in (2 * 16 * 7, 1):  # 7 positions (2 queries x 16 bytes) at a time, then one
        monkeypatch.setattr(sh, "CODE_CHUNK_BYTES", chunk_bytes)
        np.testing.assert_array_equal(proxy.logits(trace, 1, q, 90), whole)
