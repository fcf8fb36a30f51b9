"""In-loop fetches (``tracesim evict --fetch``): zero and unlimited budgets, agreement with the
offline tiers simulator on layer 0, outcome columns and option errors."""


import numpy as np
import pytest
from tracesim.capture.inloop.evict import decode_policy, layer_plans
from tracesim.capture.inloop.fetch import FetchConfig

from tests.evict_fixtures import prefilled
from tracesim.policies import make_policy
from tracesim.replay import load_layer
from tracesim.replay.engine import evaluated_queries
from tracesim.replay.kept import event_inclusion
from tracesim.tiers import MemoryModel, simulate_layer

pytestmark = pytest.mark.capture


@pytest.mark.parametrize(("design", "schedulers"), [
    ("poisson", ("random", "certificate_page", "bound", "oracle", "certificate_bound")),
    ("topk", ("random", "bound"))])
def test_zero_budget_is_plain_eviction_and_unlimited_is_the_full_cache(tiny_store, design,
                                                                        schedulers):
    store, loaded, seq, meta, P, pre = prefilled(tiny_store)
    n = len(meta["generated_ids"])
    policy = make_policy("snapkv", design, 0.3, score_params={"window": 8})
    plans = layer_plans(pre.traces, policy, 5)
    plain = decode_policy(loaded.model, pre, plans, n, set(), policy, 5)
    assert plain.generated_ids != list(meta["generated_ids"])  # the eviction matters here
    for s in (*schedulers, "none"):
        zero = decode_policy(loaded.model, pre, plans, n, set(), policy, 5,
                             fetch=FetchConfig(s, 0.0))
        # bit for bit: the same tokens, log-probs and certificates
        assert zero.generated_ids == plain.generated_ids
        assert zero.logprobs == plain.logprobs
        for a, b in zip(zero.certificates, plain.certificates, strict=True):
            assert a.keys() == b.keys()
            for layer in a:
                np.testing.assert_array_equal(a[layer][0], b[layer][0])
        assert sum(f.bytes_moved for _, _, f in zero.fetch_log) == 0
        if s == "none":
            continue
        full = decode_policy(loaded.model, pre, plans, n, set(), policy, 5,
                             fetch=FetchConfig(s, 1.0))
        assert full.generated_ids == list(meta["generated_ids"])
        log = full.fetch_log
        assert len(log) == store.model.n_layers * (n - 1)
        assert all(f.bytes_moved == f.evicted_bytes > 0 for _, _, f in log)
        if policy.certified:  # every sampled token's page came back: no tail is left
            assert all(np.all(c[layer][0] < 1e-10) for c in full.certificates for layer in c)


def _fetch_run(tiny_store, index, policy, seed, fetch):
    """Decode with ``fetch``; per layer the step queries and outputs, and the last cache."""
    import tracesim.capture.inloop.fetch as cf

    store, loaded, seq, meta, P, pre = prefilled(tiny_store, index)
    seen: dict[int, dict] = {}

    class Probe(cf.FetchState):
        def record(self, layer, query, key, value, output, mask, scaling):
            super().record(layer, query, key, value, output, mask, scaling)
            if query.shape[2] == 1:
                d = seen.setdefault(layer, {"q": {}, "o": {}})
                step = key.shape[2] - 1 - P
                d["q"][step] = query[0, :, 0].double().numpy()
                d["o"][step] = output[0, 0].double().numpy()
                d["k"], d["v"] = key[0].double().numpy(), value[0].double().numpy()

    original = cf.FetchState
    cf.FetchState = Probe
    try:
        res = decode_policy(loaded.model, pre, layer_plans(pre.traces, policy, seed),
                            len(meta["generated_ids"]), set(), policy, seed, fetch=fetch)
    finally:
        cf.FetchState = original
    return store, seq, meta, P, pre, res, seen


def _check_steps(trace, policy, seed, n_layers, fetch, res, outputs, steps) -> int:
    """Compare the run's fetches at ``steps`` of ``trace.layer`` with :func:`simulate_layer`
    on ``trace``: the same pages per KV head (count and bytes), the same modelled stall, the
    output after fetching equal to a float64 reference of the estimate with the fetched pages
    complete, and the same error against the full-cache output. Returns pages compared."""
    memory, f = fetch.memory, fetch.budget
    cols = simulate_layer(trace, policy, np.array([seed]), n_layers, memory,
                          (fetch.scheduler,), np.array([f]))
    qidx = evaluated_queries(trace, ("decode",))
    NQ, H, G = qidx.size, trace.n_heads, trace.group_size
    P = trace.prompt_length
    np.testing.assert_array_equal(trace.query_positions[qidx], P + np.arange(NQ))
    err2 = cols["err2_after"].reshape(H, NQ)
    pages = cols["pages_fetched"].reshape(H, NQ)
    kv_bytes = cols["kv_bytes_moved"].reshape(H, NQ)
    stall = cols["stall_ms"].reshape(H, NQ)[0]
    pi, kept = event_inclusion(trace, policy, seed, n_layers)
    tb = memory.token_bytes(trace.keys.shape[2])
    log = {step: sf for step, layer, sf in res.fetch_log if layer == trace.layer}
    fetched = 0
    for a in steps:
        sf = log[a]
        assert sf.stall_s * 1e3 == pytest.approx(stall[a], rel=1e-12)
        t = P + a
        K, V = trace.keys[:, :t + 1], trace.values[:, :t + 1]
        for h in range(H):
            g = h // G
            ids = sf.pages[g]
            assert pages[h, a] == ids.size
            on = np.isin(np.arange(t + 1) // memory.page, ids)
            assert kv_bytes[h, a] == ((~kept[g, :t + 1]) & on).sum() * tb
            # the estimate after the fetch: fetched pages complete (pi = 1), others 1/pi
            w = np.where(kept[g, :t + 1] | on, 1.0 / np.where(on, 1.0, pi[g, :t + 1]), 0.0)
            e = np.exp(K[g] @ trace.queries[h, qidx[a]] * trace.scale)
            np.testing.assert_allclose(outputs[a][h], (e * w) @ V[g] / (e * w).sum(),
                                       atol=2e-5)
            truth = e @ V[g] / e.sum()
            assert np.sqrt(((outputs[a][h] - truth) ** 2).sum()) == pytest.approx(
                np.sqrt(err2[h, a]), abs=2e-5)
            fetched += ids.size
    return fetched


SCHEDULERS = ["random", "certificate_page", "certificate", "bound", "oracle", "certificate_bound"]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_layer0_fetches_match_the_offline_simulator_while_tokens_agree(tiny_store, scheduler):
    """Layer 0's queries, keys and values depend only on the tokens, so while the fetch run has
    generated the full-cache tokens its decisions are those of ``tracesim tiers`` on the stored
    trace."""
    policy = make_policy("snapkv", "poisson", 0.7, score_params={"window": 8})
    fetch = FetchConfig(scheduler, 0.5, MemoryModel(page=4))
    store, seq, meta, P, pre, res, seen = _fetch_run(tiny_store, 1, policy, 7, fetch)
    full = list(meta["generated_ids"])
    # the query at P + a reads generated token a
    agree = [a for a in range(len(full) - 1) if res.generated_ids[:a + 1] == full[:a + 1]]
    assert agree
    trace = load_layer(store, seq, 0)
    assert _check_steps(trace, policy, 7, store.model.n_layers, fetch, res, seen[0]["o"],
                        agree) > 0


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_every_layer_and_step_matches_the_simulator_on_the_runs_own_cache(tiny_store,
                                                                          scheduler):
    """On the trajectory the fetch run took (its own queries, keys and values), every decode
    step of every layer fetches what ``simulate_layer`` fetches on that trace."""
    from tracesim.policies import LayerTrace

    policy = make_policy("snapkv", "poisson", 0.3, score_params={"window": 8})
    fetch = FetchConfig(scheduler, 0.3, MemoryModel(page=4))
    store, seq, meta, P, pre, res, seen = _fetch_run(tiny_store, 0, policy, 7, fetch)
    n_layers = store.model.n_layers
    fetched = 0
    for layer in range(n_layers):
        base, d = pre.traces[layer], seen[layer]
        steps = sorted(d["q"])
        assert steps == list(range(len(res.generated_ids) - 1))
        dec_q = np.stack([d["q"][a] for a in steps], axis=1)
        T = d["k"].shape[1]
        h2o = np.zeros((base.n_heads, T))
        h2o[:, :P] = base.h2o
        trace = LayerTrace(
            layer=layer, keys=d["k"], values=d["v"],
            queries=np.concatenate([base.queries, dec_q], axis=1), h2o=h2o,
            query_positions=np.r_[base.query_positions, P + np.array(steps)].astype(np.int64),
            query_roles=list(base.query_roles) + ["decode"] * len(steps), prompt_length=P,
            question_start=base.question_start, scale=base.scale)
        fetched += _check_steps(trace, policy, 7, n_layers, fetch, res, d["o"], steps)
    assert fetched > 0


def test_run_evict_with_fetch_writes_columns(tiny_store, tmp_path):
    import pyarrow.parquet as pq
    from tracesim.capture.inloop.evict_run import run_evict

    from tracesim.columns import COLUMN_DOCS

    path, loaded = tiny_store
    policies = [make_policy("snapkv", "poisson", 0.3, score_params={"window": 8}),
                make_policy("full")]
    fetch = [FetchConfig("none", 0.0), FetchConfig("certificate_page", 0.0),
             FetchConfig("certificate_page", 0.25), FetchConfig("random", 1.0)]
    summary = run_evict(path, policies, seeds=1, out=tmp_path / "f", model=loaded,
                        progress=False, fetch=fetch)
    plain = run_evict(path, policies, seeds=1, out=tmp_path / "p", model=loaded,
                      progress=False)
    assert summary["accuracy"] == plain["accuracy"]  # configurations without fetching
    table = pq.read_table(tmp_path / "f" / "outcomes.parquet")
    ref = pq.read_table(tmp_path / "p" / "outcomes.parquet").to_pandas()
    df = table.to_pandas()
    assert summary["n_rows"] == len(df) == 2 * (4 + 1)
    new = [c for c in df.columns if c not in ref.columns]
    assert new and all(c.startswith("fetch_") and c in COLUMN_DOCS for c in new)
    assert not [c for c in ref.columns if c.startswith("fetch")]  # plain runs are unchanged
    full = df[df.score == "full"]
    assert full[new].isna().all().all()
    ev = df[df.score != "full"]
    assert ev[new].notna().all().all()
    keys = ["sequence_id", "config_id"]
    base = ref[ref.score != "full"].set_index(keys).sort_index()
    for s, b in (("none", 0.0), ("certificate_page", 0.0)):
        rows = ev[(ev.fetch_scheduler == s) & (ev.fetch_budget == b)].set_index(keys).sort_index()
        assert (rows.fetch_bytes == 0).all()
        for c in ("answer", "logprob_mean", "certificate_mean", "layer_certificate_max"):
            assert rows[c].tolist() == base[c].tolist()
    mid = ev[ev.fetch_budget == 0.25]
    assert ((mid.fetch_bytes_share > 0) & (mid.fetch_bytes_share <= 0.25 + 1e-12)).all()
    assert (mid.fetch_stall_ms > 0).all() and (mid.fetch_pages > 0).all()
    one = ev[ev.fetch_scheduler == "random"]
    assert (one.fetch_bytes_share == 1).all() and one.same_tokens_as_full.all()
    accs = summary["fetch"]["accuracy"]
    assert {(r["fetch_scheduler"], r["fetch_budget"]) for r in accs} == {
        ("none", 0.0), ("certificate_page", 0.0), ("certificate_page", 0.25), ("random", 1.0)}


@pytest.mark.parametrize(("extra", "grid", "words"), [
    (["--fetch", "nope"], "poisson", ["--fetch", "nope"]),
    (["--fetch", "confidence"], "poisson", ["--fetch", "confidence", "offline"]),
    (["--fetch", "random", "--fetch-budget", "1.5"], "poisson", ["--fetch-budget", "1.5"]),
    (["--fetch", "random", "--fetch-budget", "x"], "poisson", ["--fetch-budget", "'x'"]),
    (["--fetch-budget", "0.1"], "poisson", ["--fetch-budget", "--fetch"]),
    (["--fetch", "certificate_page"], "topk", ["--fetch", "certified"]),
    (["--fetch", "random"], "decode", ["--fetch", "one-shot"]),
    (["--fetch", "random", "--tiers-spec", "BAD"], "poisson", ["--tiers-spec", "page"]),
    (["--fetch", "random", "--tiers-spec", "MISSING"], "poisson", ["--tiers-spec"]),
])
def test_bad_fetch_options_exit_2(tiny_store, tmp_path, capsys, extra, grid, words):
    from tracesim.app.cli import main

    path, _ = tiny_store
    design = "topk" if grid == "topk" else "poisson"
    sched = "\n  schedule: ['decode:2']" if grid == "decode" else ""
    g = tmp_path / "grid.yaml"
    g.write_text(f"grid:\n  score: [snapkv]\n  design: [{design}]\n  budget: [0.3]{sched}\n")
    bad = tmp_path / "tiers.yaml"
    bad.write_text("memory:\n  page: 0\n")
    extra = [str(bad) if e == "BAD" else str(tmp_path / "none.yaml") if e == "MISSING" else e
             for e in extra]
    # the checks run before any model is loaded
    rc = main(["evict", str(path), "--grid", str(g), "--out", str(tmp_path / "o"),
               "--model", str(tmp_path / "no-model"), *extra])
    err = capsys.readouterr().err
    assert rc == 2
    for w in words:
        assert w in err, err


def test_host_copies_over_their_budget_are_converted_each_step_with_the_same_run(
        tiny_store, monkeypatch):
    """Beyond ``HOST_COPY_BYTES`` every step converts its layer's cache afresh; the fetches,
    tokens and certificates are those of the run that keeps the copies."""
    import tracesim.capture.inloop.fetch as cf

    store, loaded, seq, meta, P, pre = prefilled(tiny_store)
    n = len(meta["generated_ids"])
    policy = make_policy("snapkv", "poisson", 0.3, score_params={"window": 8})
    plans = layer_plans(pre.traces, policy, 5)
    fetch = FetchConfig("certificate_bound", 0.3, MemoryModel(page=4))
    runs = []
    for budget in (cf.HOST_COPY_BYTES, 0):
        monkeypatch.setattr(cf, "HOST_COPY_BYTES", budget)
        runs.append(decode_policy(loaded.model, pre, plans, n, set(), policy, 5, fetch=fetch))
    kept, fresh = runs
    assert kept.generated_ids == fresh.generated_ids
    assert sum(f.pages_fetched for _, _, f in kept.fetch_log) > 0
    for (s1, l1, f1), (s2, l2, f2) in zip(kept.fetch_log, fresh.fetch_log, strict=True):
        assert (s1, l1, f1.bytes_moved, f1.stall_s) == (s2, l2, f2.bytes_moved, f2.stall_s)
        for a, b in zip(f1.pages, f2.pages, strict=True):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(kept.certificates, fresh.certificates, strict=True):
        for layer in a:
            np.testing.assert_array_equal(a[layer][0], b[layer][0])
