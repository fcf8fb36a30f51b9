"""Per-step designs in the loop: full budget is the full cache, the first step is the replay's."""

import copy

import numpy as np
import pytest
import tracesim.capture.inloop.perstep as perstep_mod
from tracesim.capture.inloop.evict import decode_policy, layer_plans, prefill_sequence
from tracesim.capture.inloop.perstep import STEP_COLUMNS, step_trace

from tests.evict_fixtures import prefilled
from tracesim import hajek_attention
from tracesim.policies import make_policy
from tracesim.replay import ReplayOptions, layer_batch, replay_layer
from tracesim.replay.kept import event_inclusion
from tracesim.store import open_store

pytestmark = pytest.mark.capture


def _policy(design, budget, proxy="exact", schedule="step"):
    return make_policy("perstep", design, budget, schedule=schedule,
                       score_params={"window": 8, "proxy": proxy})


@pytest.mark.parametrize(("proxy", "design", "schedule"), [
    ("exact", "poisson", "step"), ("quant:4", "topk", "step"), ("pages:16", "topk", "step"),
    ("quant:4", "bernoulli", "step"), ("quant:4", "poisson", "step:permanent"),
    ("simhash:10,150", "poisson", "step"), ("lowrank:8", "topk", "step")])
def test_full_budget_gives_the_full_cache_tokens(tiny_store, proxy, design, schedule):
    path, loaded = tiny_store
    store = open_store(path)
    policy = _policy(design, 1.0, proxy, schedule)
    for index in range(len(store.sequence_ids)):
        _, _, _, meta, P, pre = prefilled(tiny_store, index)
        assert layer_plans(pre.traces, policy, 0) == {}  # nothing is drawn after prefill
        n = len(meta["generated_ids"])
        res = decode_policy(loaded.model, pre, {}, n, set(), policy, 3)
        assert res.generated_ids == list(meta["generated_ids"])
        assert res.step_positions == list(range(P, P + n - 1)) and res.history == []
        for t, kept in zip(res.step_positions, res.step_kept, strict=True):
            assert (kept == t).all()  # every token of [0, t) is read at every step


@pytest.fixture(scope="module")
def float64_run(tiny_store):
    """(store, float64 copy of the tiny model, meta, prompt length, prefill)."""
    path, loaded = tiny_store
    store = open_store(path)
    model = copy.deepcopy(loaded.model).double()
    meta = store[store.sequence_ids[0]].meta
    P = int(meta["prompt_length"])
    pre = prefill_sequence(model, list(meta["token_ids"])[:P],
                           question_start=int(meta["question_start"]), window=8,
                           scaling=store.model.scaling)
    return store, model, meta, P, pre


def _first_steps(monkeypatch, model, pre, policy, seed, n_new=3):
    """Decode under ``policy`` on the reference path; per layer, the first decode step's
    ``(query (H, d), keys, values (n_kv, P + 1, d), output (H, d), plan)`` in float64."""
    first = {}

    class Probe(perstep_mod.PerStepState):
        def record(self, layer, query, key, value, output, mask, scaling):
            super().record(layer, query, key, value, output, mask, scaling)
            if query.shape[2] == 1 and layer not in first:
                first[layer] = (*(t.double().numpy() for t in (
                    query[0, :, 0], key[0], value[0], output[0, 0])), self.plans[layer])

    monkeypatch.setattr(perstep_mod, "PerStepState", Probe)
    res = decode_policy(model, pre, {}, n_new, set(), policy, seed, one_pass=False)
    return res, first


@pytest.mark.parametrize(("proxy", "design", "schedule"), [
    ("exact", "poisson", "step"), ("quant:4", "poisson", "step"), ("exact", "topk", "step"),
    ("quant:4", "topk", "step"), ("quant:4", "poisson", "step:permanent")])
def test_first_step_estimate_equals_the_replay(monkeypatch, float64_run, proxy, design,
                                               schedule):
    """At the first decode step, in every layer, the model's enforced attention output (float64
    model, SDPA reference path) is the replay engine's estimate on the same layer trace: same
    kept set and pi, the same error against the full-cache output to 1e-6, the Hájek estimate
    to 1e-6 and the same certificate."""
    store, model, meta, P, pre = float64_run
    policy = _policy(design, 0.3, proxy, schedule)
    seed = 5 if policy.needs_seeds else 0
    res, first = _first_steps(monkeypatch, model, pre, policy, seed)
    n_layers = store.model.n_layers
    assert sorted(first) == list(range(n_layers)) and res.step_positions[0] == P
    evicted = 0
    for layer in range(n_layers):
        q, k, v, out, plan = first[layer]
        import torch

        trace = step_trace(pre.traces[layer], None, torch.from_numpy(q), torch.from_numpy(k),
                           torch.from_numpy(v))
        assert trace.n_positions == P + 1 and trace.query_positions[-1] == P
        pi, kept = event_inclusion(trace, policy, seed, n_layers, P)
        np.testing.assert_array_equal(plan.kept.numpy(), kept)
        np.testing.assert_array_equal(plan.pi.numpy(), pi)
        evicted += int((~kept).sum())
        result = replay_layer(trace, [policy], np.array([seed]), n_layers,
                              options=ReplayOptions(output_space=False))
        rows = layer_batch(result, per_seed=True).to_pandas()
        assert rows.query_position.tolist() == [P] * trace.n_heads
        rows = rows.set_index("head").sort_index()
        G = trace.group_size
        for h in range(trace.n_heads):
            g = h // G
            logits = trace.scale * (k[g] @ q[h])
            a = np.exp(logits - logits.max())
            truth = (a / a.sum()) @ v[g]
            err = float(np.linalg.norm(out[h] - truth))
            assert err == pytest.approx(float(np.sqrt(rows.err2[h])), abs=1e-6)
            est = hajek_attention(q[h], k[g], v[g], pi[g], kept[g], scale=trace.scale,
                                  correction=True, variance="trace")
            np.testing.assert_allclose(out[h], est.estimate, atol=1e-6, rtol=0)
            assert rows.kept_tokens[h] == int(kept[g, :P].sum())  # the current token aside
            if policy.certified:
                assert res.certificates[0][layer][0][h] == pytest.approx(
                    float(rows.cert2[h]), rel=1e-5, abs=1e-9)
        if not policy.certified:
            assert not res.certificates
    assert evicted > 0  # the budget bites


def test_per_step_draws_are_fresh_or_permanent_and_reruns_are_identical(tiny_store):
    _, loaded, _, meta, P, pre = prefilled(tiny_store)
    n = len(meta["generated_ids"])
    runs = {}
    for schedule in ("step", "step:permanent"):
        policy = _policy("poisson", 0.3, "quant:4", schedule)
        a = decode_policy(loaded.model, pre, {}, n, set(), policy, 7)
        b = decode_policy(loaded.model, pre, {}, n, set(), policy, 7)
        assert a.generated_ids == b.generated_ids and a.logprobs == b.logprobs
        assert [s.tolist() for s in a.step_kept] == [s.tolist() for s in b.step_kept]
        for ca, cb in zip(a.certificates, b.certificates, strict=True):
            assert all(np.array_equal(ca[k][0], cb[k][0]) for k in ca)
        runs[schedule] = a
    # The per-step budget is a share of the step's own cache [0, t).
    for t, kept in zip(runs["step"].step_positions, runs["step"].step_kept, strict=True):
        assert (kept < t).all() and abs(kept.mean() / t - 0.3) < 0.1


def test_run_evict_with_per_step_designs_writes_step_costs_and_resumes(tiny_store, tmp_path):
    import pyarrow.parquet as pq
    from tracesim.capture.inloop.evict_run import run_evict

    from tracesim.columns import COLUMN_DOCS

    path, loaded = tiny_store
    policies = [_policy("poisson", 0.3, "quant:4"), _policy("topk", 0.3, "quant:4"),
                make_policy("snapkv", "topk", 0.3, score_params={"window": 8}),
                make_policy("full")]
    out = tmp_path / "outcomes"
    summary = run_evict(path, policies, seeds=2, out=out, model=loaded, progress=False)
    table = pq.read_table(out / "outcomes.parquet").to_pandas()
    assert summary["n_rows"] == len(table) == 2 * (2 + 1 + 1 + 1)
    assert all(c in table.columns and c in COLUMN_DOCS for c in STEP_COLUMNS)
    full = table[table.score == "full"]
    assert full.same_tokens_as_full.all() and (full.step_tokens_fraction == 1).all()
    assert (full.step_rows_read == 0).all() and (full.step_us == 0).all()
    step = table[table.score == "perstep"]
    assert (step.step_rows_read > 0).all() and (step.step_us > 0).all()
    assert ((step.step_tokens_fraction > 0.15) & (step.step_tokens_fraction < 0.5)).all()
    assert step[step.design == "poisson"].certificate_mean.notna().all()
    snap = table[table.score == "snapkv"]
    assert (snap.step_rows_read == 0).all() and (snap.step_bytes < full.step_bytes.max()).all()
    # Resume: a finished sequence is kept; a removed one is recomputed, identically.
    parts = sorted((out / "parts").glob("*/*.parquet"))
    parts[0].unlink()
    again = run_evict(path, policies, seeds=2, out=out, model=loaded, progress=False)
    assert again["sequences_skipped"] == 1 and again["sequences_written"] == 1
    rerun = pq.read_table(out / "outcomes.parquet").to_pandas()
    drop = ["decode_seconds"]
    assert rerun.drop(columns=drop).equals(table.drop(columns=drop))


@pytest.mark.parametrize(("params", "field"), [
    ("design: [poisson]\n  score_params: {perstep: {proxy: 'quant:3'}}", "bits"),
    ("design: [fixed]", "fixed"),
    ("design: [poisson]\n  score_params: {perstep: {gqa: median}}", "gqa")])
def test_bad_per_step_options_exit_2_naming_the_field(tiny_store, tmp_path, capsys, params,
                                                       field):
    from tracesim.app.cli import main

    path, _ = tiny_store
    grid = tmp_path / "bad.yaml"
    grid.write_text(f"grid:\n  score: [perstep]\n  budget: [0.3]\n  schedule: [step]\n"
                    f"  {params}\nseeds: 1\n")
    assert main(["evict", str(path), "--grid", str(grid), "--out", str(tmp_path / "o")]) == 2
    assert field in capsys.readouterr().err
