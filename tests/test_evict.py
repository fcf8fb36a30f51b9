"""In-loop eviction: full budget reproduces the full-cache run; simulator and model agree."""

from pathlib import Path

import numpy as np
import pytest
import torch
from tracesim.capture.inloop.evict import (
    decode_policy,
    failure_label,
    layer_plans,
    prefill_sequence,
)

from tests.evict_fixtures import prefilled
from tracesim import hajek_attention, output_space_certificate
from tracesim.policies import make_policy
from tracesim.replay import load_layer, replay
from tracesim.replay.kept import first_event_inclusion
from tracesim.store import open_store

pytestmark = pytest.mark.capture


@pytest.mark.parametrize(("score", "design"), [("snapkv", "topk"), ("h2o", "poisson"),
                                               ("streaming", "bernoulli"), ("tova", "fixed")])
def test_full_budget_reproduces_full_cache_tokens(tiny_store, score, design):
    path, loaded = tiny_store
    store = open_store(path)
    for seq in store:
        meta = seq.meta
        P = int(meta["prompt_length"])
        pre = prefill_sequence(loaded.model, list(meta["token_ids"])[:P],
                               question_start=int(meta["question_start"]), window=8,
                               scaling=store.model.scaling)
        policy = make_policy(score, design, 1.0, score_params={"window": 8})
        plans = layer_plans(pre.traces, policy, seed=0)
        res = decode_policy(loaded.model, pre, plans, len(meta["generated_ids"]), set())
        assert res.generated_ids == list(meta["generated_ids"])
        # the cache is restored: a second decode gives the same again
        again = decode_policy(loaded.model, pre, plans, len(meta["generated_ids"]), set())
        assert again.generated_ids == res.generated_ids


@pytest.mark.parametrize(("score", "design", "budget"), [
    ("snapkv", "poisson", 0.3), ("h2o", "bernoulli", 0.4), ("knorm", "fixed", 0.35),
    ("keyformer", "topk", 0.3)])
def test_simulator_and_model_agree_on_kept_sets_outputs_and_certificates(
        tiny_store, score, design, budget):
    """Same kept sets; at the first decode step the model's enforced attention outputs and its
    serving-time certificates equal tracesim's estimator on the same cache, in every layer; and
    in layer 0 (whose query no eviction has touched yet) they equal the replay engine's."""
    import tracesim.capture.inloop.evict as ev
    from tracesim.capture.inloop.enforce import EvictionState

    store, loaded, seq, meta, P, pre = prefilled(tiny_store)
    policy = make_policy(score, design, budget, score_params={"window": 8})
    seed = 5
    plans = layer_plans(pre.traces, policy, seed)
    n_layers = store.model.n_layers
    first_step = {}

    class Probe(EvictionState):
        def record(self, layer, query, key, value, output, mask, scaling):
            super().record(layer, query, key, value, output, mask, scaling)
            if query.shape[2] == 1 and layer not in first_step:
                first_step[layer] = tuple(t.double().numpy() for t in (
                    query[0, :, 0], key[0], value[0], output[0, 0]))

    original = ev.EvictionState
    ev.EvictionState = Probe
    try:
        res = decode_policy(loaded.model, pre, plans, 2, set())
    finally:
        ev.EvictionState = original
    assert len(res.generated_ids) == 2
    for layer in range(n_layers):
        trace = load_layer(store, seq, layer)
        pi_sim, kept_sim = first_event_inclusion(trace, policy, seed, n_layers)
        np.testing.assert_array_equal(plans[layer].kept.numpy(), kept_sim[:, :P])
        np.testing.assert_allclose(plans[layer].pi.numpy(), pi_sim[:, :P], rtol=1e-12)
        q, k, v, out = first_step[layer]  # k, v: (n_kv, P + 1, d), the cache at this step
        pis = np.concatenate([plans[layer].pi.numpy(), np.ones((k.shape[0], 1))], axis=1)
        keeps = np.concatenate([plans[layer].kept.numpy(), np.ones((k.shape[0], 1), bool)], 1)
        G = trace.group_size
        for h in range(trace.n_heads):
            g = h // G
            est = hajek_attention(q[h], k[g], v[g], pis[g], keeps[g], scale=trace.scale,
                                  correction=policy.correction == "hajek", variance="trace",
                                  design_variance=policy.design.variance or "poisson")
            np.testing.assert_allclose(out[h], est.estimate, atol=1e-5)
            if policy.certified:
                assert res.certificates[0][layer][0][h] == pytest.approx(
                    float(est.variance_trace), abs=1e-5, rel=1e-4)
        if policy.certified:
            layer_cert = output_space_certificate(q[:, None, :], k, v, pis, keeps,
                                                  store.o_proj(layer).astype(np.float64),
                                                  scale=trace.scale)
            assert res.certificates[0][layer][1] == pytest.approx(
                float(layer_cert.variance_trace[0]), rel=1e-4, abs=1e-5)
        else:
            assert not res.certificates
    # Layer 0 at the first decode step sees exactly the recorded full-cache query.
    trace0 = load_layer(store, seq, 0)
    np.testing.assert_allclose(first_step[0][0],
                               trace0.queries[:, list(trace0.query_positions).index(P)],
                               atol=1e-6)
    if policy.certified:
        table = replay(store, [policy], seeds=[seed], sequences=[seq.sequence_id], layers=[0],
                       per_seed=True, progress=False).to_pandas()
        first = table[table.query_position == P]
        assert len(first) == trace0.n_heads
        for _, row in first.iterrows():
            assert row.cert2 == pytest.approx(res.certificates[0][0][0][int(row["head"])],
                                              rel=1e-4, abs=1e-5)


def test_per_head_kept_sets_differ_under_gqa(tiny_store):
    store, loaded, seq, meta, P, pre = prefilled(tiny_store)
    plans = layer_plans(pre.traces, make_policy("snapkv", "topk", 0.3,
                                                score_params={"window": 8}), 0)
    kept = plans[0].kept.numpy()
    assert kept.shape[0] == 2 and (kept[0] != kept[1]).any()
    assert torch.isinf(plans[0].bias).any()


def test_decode_schedule_holds_memory_at_the_budget(tiny_store):
    # Budgets are fractions of the context (the prompt), so under decode-time eviction 100% keeps
    # the whole prompt at the first event and then holds the cache at the prompt's size: every
    # later event evicts, in expectation, exactly the tokens generated since.
    store, loaded, seq, meta, P, pre = prefilled(tiny_store)
    n = len(meta["generated_ids"])
    policy = make_policy("h2o", "poisson", 1.0, schedule="decode:2", score_params={"window": 8})
    res = decode_policy(loaded.model, pre, layer_plans(pre.traces, policy, 0), n, set(),
                        policy, 0)
    assert [tau for tau, _ in res.history] == [P, *range(P + 2, P + n, 2)]
    first = res.history[0][1]
    assert all(bool((p.pi == 1).all()) for p in first.values())
    for tau, plans in res.history[1:]:
        for p in plans.values():
            assert p.pi.shape[1] == tau
            # the nested rule only lowers probabilities, so memory is at most the budget
            assert (p.pi.sum(dim=1) <= P + 1e-6).all()


@pytest.mark.parametrize(("score", "design"), [("h2o", "poisson"), ("tova", "topk")])
def test_decode_schedule_replans_like_the_simulator(tiny_store, score, design):
    """Each event re-plans from what exists then. Layer 0's queries, keys and values depend only
    on the tokens, so while the evicted run repeats the full-cache tokens its events must keep
    exactly what the replay engine keeps on the stored trace."""
    from tracesim.replay.inclusion import slot_events

    store, loaded, seq, meta, P, pre = prefilled(tiny_store)
    policy = make_policy(score, design, 0.6, schedule="decode:2", score_params={"window": 8})
    n = len(meta["generated_ids"])
    res = decode_policy(loaded.model, pre, layer_plans(pre.traces, policy, 3), n, set(),
                        policy, 3)
    assert len(res.history) >= 2
    for tau, plans in res.history:
        assert plans[0].pi.shape[1] == tau
    # Nested rule: effective probabilities never grow from one event to the next.
    for (t0, a), (_, b) in zip(res.history, res.history[1:], strict=False):
        assert (b[1].pi[:, :t0] <= a[1].pi + 1e-12).all()
    trace = load_layer(store, seq, 0)
    qpos = trace.query_positions[trace.query_positions >= P]
    pi_sim, taus, _ = slot_events(trace, policy, 3, store.model.n_layers, qpos)
    full = list(meta["generated_ids"])
    checked = 0
    for tau, plans in res.history:
        # tokens fed before tau: generated[:tau - P]; compare only while they match the full run
        if res.generated_ids[:tau - P] != full[:tau - P]:
            break
        e = int(np.searchsorted(taus, tau, side="right") - 1)
        np.testing.assert_allclose(plans[0].pi.numpy(), pi_sim[e][:, :tau], rtol=1e-9,
                                   atol=1e-12)
        checked += 1
    assert checked >= 1


def test_failure_labels():
    assert failure_label(False, True) == "cache_induced"
    assert failure_label(False, False) == "inherent"
    assert failure_label(True, True) == "none"
    assert failure_label(True, False) == "recovered"


def test_run_evict_writes_outcomes_and_resumes(tiny_store, tmp_path):
    import pyarrow.parquet as pq
    from tracesim.capture.inloop.evict_run import run_evict

    path, loaded = tiny_store
    policies = [make_policy("snapkv", "poisson", 0.3, score_params={"window": 8}),
                make_policy("snapkv", "topk", 0.3, score_params={"window": 8}),
                make_policy("full")]
    out = tmp_path / "outcomes"
    summary = run_evict(path, policies, seeds=2, out=out, model=loaded, progress=False)
    table = pq.read_table(out / "outcomes.parquet").to_pandas()
    # 2 sequences x (2 seeds of poisson + topk once + full once)
    assert summary["n_rows"] == len(table) == 2 * 4
    full = table[table.score == "full"]
    assert full.same_tokens_as_full.all() and (full.correct == full.full_correct).all()
    poisson = table[table.design == "poisson"]
    assert poisson.certificate_mean.notna().all() and (poisson.certificate_mean > 0).all()
    assert poisson.layer_certificate_max.notna().all()
    assert table[table.design == "topk"].certificate_mean.isna().all()
    assert set(table.failure) <= {"none", "inherent", "cache_induced", "recovered"}
    assert (table.kept_fraction <= 1).all() and (poisson.kept_fraction < 0.9).all()
    # Resuming does no work and keeps the same rows.
    (out / "outcomes.parquet").unlink()
    again = run_evict(path, policies, seeds=2, out=out, model=loaded, progress=False)
    assert again["sequences_skipped"] == 2 and again["sequences_written"] == 0
    assert pq.read_table(out / "outcomes.parquet").num_rows == len(table)


def test_evict_cli_with_a_checkpoint_directory(tiny_store, tmp_path):
    from tracesim.app.cli import main

    path, loaded = tiny_store
    ckpt = tmp_path / "tiny-llama"
    loaded.model.save_pretrained(ckpt, safe_serialization=True)
    loaded.tokenizer.save_pretrained(ckpt)
    grid = tmp_path / "grid.yaml"
    grid.write_text("grid:\n  score: [streaming]\n  design: [bernoulli]\n  budget: [0.5]\n"
                    "  score_params: {streaming: {window: 8}}\nseeds: 1\n")
    assert main(["evict", str(path), "--grid", str(grid), "--out", str(tmp_path / "o"),
                 "--model", str(ckpt)]) == 0
    assert (tmp_path / "o" / "outcomes.parquet").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("grid:\n  score: [nope]\n")
    assert main(["evict", str(path), "--grid", str(bad), "--out", str(tmp_path / "o2"),
                 "--model", str(ckpt)]) == 2
    # --per-task: the first sequence of each task now, the rest later into the same --out
    import json

    import pyarrow.parquet as pq

    from tracesim.store import open_store

    manifest = open_store(path).manifest.to_pandas()
    first = manifest.groupby("task", sort=False)["sequence_id"].first().tolist()
    args = ["evict", str(path), "--grid", str(grid), "--out", str(tmp_path / "o3"), "--model",
            str(ckpt)]
    assert main(args + ["--per-task", "1"]) == 0
    part = pq.read_table(tmp_path / "o3" / "outcomes.parquet").to_pandas()
    assert sorted(part.sequence_id) == sorted(first)
    assert main(args) == 0
    summary = json.loads((tmp_path / "o3" / "summary.json").read_text())
    assert summary["sequences_skipped"] == len(first)
    assert summary["sequences_written"] == len(manifest) - len(first)
    assert main(args + ["--per-task", "0"]) == 2


def test_evict_sigkill_then_rerun_and_rekeyed_resume(tiny_store, tmp_path):
    """Kill ``tracesim evict`` after its first sequence part; the rerun equals an uninterrupted
    run. A rerun with another seed count into the same OUT computes new rows (resume is keyed
    by configuration and seeds), and a concurrent second run is refused."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import pyarrow.parquet as pq
    from tracesim.capture.inloop.evict_run import run_evict

    from tracesim.app.cli import main
    from tracesim.atomic import DirLock

    path, loaded = tiny_store
    ckpt = tmp_path / "tiny-llama"
    loaded.model.save_pretrained(ckpt, safe_serialization=True)
    loaded.tokenizer.save_pretrained(ckpt)
    grid = tmp_path / "grid.yaml"
    grid.write_text("grid:\n  score: [snapkv]\n  design: [poisson, topk]\n  budget: [0.4]\n"
                    "  score_params: {snapkv: {window: 8}}\nseeds: 2\n")
    out = tmp_path / "o"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-m", "tracesim.app.cli", "evict", str(path),
                             "--grid", str(grid), "--out", str(out), "--model", str(ckpt)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not list(out.glob("parts/*/*.parquet")) and proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert main(["evict", str(path), "--grid", str(grid), "--out", str(out), "--model",
                 str(ckpt)]) == 0
    got = pq.read_table(out / "outcomes.parquet").drop(["decode_seconds"])
    policies = [make_policy("snapkv", d, 0.4, score_params={"window": 8})
                for d in ("poisson", "topk")]
    ref = run_evict(path, policies, seeds=2, out=tmp_path / "ref", model=str(ckpt),
                    progress=False)
    want = pq.read_table(tmp_path / "ref" / "outcomes.parquet").drop(["decode_seconds"])
    assert ref["n_rows"] == got.num_rows and got.equals(want)
    assert not list(out.rglob("*.tmp"))
    # Another seed count into the same OUT: new rows, not the old outcomes.
    again = run_evict(path, policies, seeds=3, out=out, model=str(ckpt), progress=False)
    assert again["sequences_written"] == 2 and again["n_rows"] == 2 * (3 + 1)
    with DirLock(out), pytest.raises(ValueError, match="another"):
        run_evict(path, policies, seeds=2, out=out, model=str(ckpt), progress=False)


def test_evict_prefills_with_the_stores_capture_window(tmp_path, tiny_store):
    # A store captured with a 40-query window: SnapKV reading 40 window queries runs in the
    # loop (the prefill used to record the default 32 and refused).
    from tracesim.capture.inloop.evict_run import run_evict
    from tracesim.capture.runner import CaptureConfig, run_capture

    _, loaded = tiny_store
    out = tmp_path / "w40"
    run_capture(loaded, ["passkey"], n=1, length=160, out=out, storage_dtype="float32",
                config=CaptureConfig(window=40, max_new_tokens=4), progress=False)
    ckpt = tmp_path / "tiny"
    loaded.model.save_pretrained(ckpt, safe_serialization=True)
    loaded.tokenizer.save_pretrained(ckpt)
    pol = make_policy("snapkv", "topk", 0.5, score_params={"window": 40})
    res = run_evict(out, [pol], seeds=1, out=tmp_path / "o", model=str(ckpt), progress=False)
    assert res["n_rows"] == 1
    import pyarrow.parquet as pq

    assert pq.read_table(tmp_path / "o" / "outcomes.parquet").column("config_id")[0].as_py() \
        == pol.id
