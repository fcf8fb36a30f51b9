"""Tiered KV memory: model, schedulers, simulator invariants, byte accounting, CLI, analysis."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from tracesim.analysis.tiers import compare_schedulers, scheduler_curves, tiers_figure

from tests.replay_fixtures import build_store, synthetic_trace
from tracesim.app.cli import main
from tracesim.policies import policy_grid
from tracesim.replay import replay_layer
from tracesim.replay.kept import event_inclusion
from tracesim.tiers import (
    SCHEDULERS,
    MemoryModel,
    Tier,
    TierError,
    parse_tiers_spec,
    run_tiers,
    simulate_layer,
)
from tracesim.tiers.schedulers import confidence_weights

GRID = {"score": ["snapkv"], "design": ["poisson"], "budget": [0.25],
        "score_params": {"*": {"window": 8}}, "design_params": {"poisson": {"mixture": 0.1}}}


def _policy(design: str = "poisson"):
    return policy_grid(["snapkv"], [design], [0.25], score_params={"snapkv": {"window": 8}},
                       design_params={"poisson": {"mixture": 0.1}})[0]


def _frame(cols: dict) -> pd.DataFrame:
    return pd.DataFrame({k: np.asarray(v) for k, v in cols.items()})


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(3, n_heads=4, n_kv=2, d=8, P=96, prompt_length=80)


def test_tier_and_model_validation_names_the_field():
    with pytest.raises(TierError, match="bandwidth_gbps"):
        Tier("dram", bandwidth_gbps=0.0)
    with pytest.raises(TierError, match="latency_us"):
        Tier("dram", bandwidth_gbps=1.0, latency_us=-1.0)
    with pytest.raises(TierError, match="queue_depth"):
        Tier("dram", bandwidth_gbps=1.0, queue_depth=0)
    with pytest.raises(TierError, match="page"):
        MemoryModel(page=0)
    with pytest.raises(TierError, match="schedulers"):
        parse_tiers_spec({"grid": GRID, "schedulers": ["lru"]})
    with pytest.raises(TierError, match=r"fetch_budgets\[0\]"):
        parse_tiers_spec({"grid": GRID, "fetch_budgets": [1.5]})
    with pytest.raises(TierError, match=r"memory.*bandwidth_gbps"):
        parse_tiers_spec({"grid": GRID, "memory": {"tiers": [{"name": "x",
                                                              "bandwidth_gbps": -3}]}})
    with pytest.raises(TierError, match="certificate"):
        parse_tiers_spec({"grid": {"score": ["snapkv"], "design": ["topk"], "budget": [0.25]},
                          "schedulers": ["certificate"]})


def test_fetch_time_placement_and_overlap_by_hand():
    dram = Tier("dram", bandwidth_gbps=10.0, latency_us=5.0, capacity_gb=1e-6, queue_depth=2)
    nvme = Tier("nvme", bandwidth_gbps=2.0, latency_us=50.0, capacity_gb=1.0, queue_depth=4)
    m = MemoryModel(lower=(dram, nvme), overlap=False)
    # 3 DRAM fetches: 2 waves x 5 us + 3000 B / 10 GB/s; 1 NVMe fetch: 50 us + 1000 B / 2 GB/s.
    fetch, stall = m.step_times(np.array([[3, 1]]), np.array([[3000.0, 1000.0]]),
                                np.array([0.0]))
    t_dram = 2 * 5e-6 + 3000 / 10e9
    t_nvme = 50e-6 + 1000 / 2e9
    assert fetch[0] == pytest.approx(max(t_dram, t_nvme), rel=1e-12)
    assert stall[0] == fetch[0]
    mo = MemoryModel(lower=(dram, nvme), overlap=True, hbm_bandwidth_gbps=1.0)
    _, st = mo.step_times(np.array([[3, 1]]), np.array([[3000.0, 1000.0]]),
                          np.array([20_000.0]))          # 20 us of compute hides 20 us
    assert st[0] == pytest.approx(max(t_dram, t_nvme) - 20e-6, rel=1e-9)
    # 1 kB of DRAM: the first page fits, the next ones spill to NVMe.
    assert m.placement(np.array([600.0, 600.0, 600.0])).tolist() == [0, 1, 1]


def test_zero_bytes_is_plain_eviction_and_unlimited_is_the_full_cache(trace):
    pol = _policy()
    cols = _frame(simulate_layer(trace, pol, np.arange(3), 2, MemoryModel(page=4), SCHEDULERS,
                                 np.array([0.0, 0.1, 1.0])))
    zero = cols[cols.fetch_budget == 0]
    np.testing.assert_array_equal(zero.err2_after, zero.err2_before)
    assert (zero.kv_bytes_moved == 0).all()
    full = cols[(cols.fetch_budget == 1) & (cols.scheduler != "none")]
    assert full.err2_after.max() == 0.0
    np.testing.assert_allclose(full.kv_bytes_moved, full.evicted_bytes)
    none = cols[cols.scheduler == "none"]
    np.testing.assert_array_equal(none.err2_after, none.err2_before)
    # The plain-eviction error is the replay engine's (same seeds, same estimator).
    res = replay_layer(trace, [pol], np.arange(3), 2)
    from tracesim.kernels.replay import F_ERR2
    rep = res.out[:, :, :, F_ERR2].mean(axis=0)                 # (H, NQ)
    one = cols[(cols.scheduler == "none") & (cols.fetch_budget == 0)]
    ours = one.sort_values(["head", "step"]).err2_before.to_numpy().reshape(rep.shape)
    np.testing.assert_allclose(ours, rep, rtol=1e-9, atol=1e-14)


def test_byte_accounting_matches_a_hand_count(trace):
    pol = _policy("topk")
    page, d = 4, trace.keys.shape[2]
    mem = MemoryModel(page=page, bytes_per_element=2)
    cols = _frame(simulate_layer(trace, pol, np.arange(1), 2, mem, ("oracle",),
                                 np.array([0.3, 1.0])))
    _, kept = event_inclusion(trace, pol, 0, 2)
    token_bytes = 2 * d * 2
    for g in range(trace.n_kv_heads):
        missing = np.flatnonzero(~kept[g])
        hand = missing.size * token_bytes                         # all visible to decode steps
        ev = cols[(cols.kv_head == g)].evicted_bytes.unique()
        assert ev.tolist() == [hand]
        # bytes are whole pages: a multiple of the token size, at most the budget share
        pages = np.unique(missing // page, return_counts=True)[1] * token_bytes
        got = cols[(cols.kv_head == g) & (cols.fetch_budget == 0.3)].kv_bytes_moved
        assert np.all(np.isin(got % token_bytes, [0]))
        assert got.max() <= pages.sum()
    layer_total = sum(np.count_nonzero(~kept[g]) for g in range(trace.n_kv_heads)) * token_bytes
    per_step = cols[cols.fetch_budget == 0.3].groupby("step").bytes_moved.sum()
    assert (per_step <= 0.3 * layer_total + 1e-9).all()
    assert (per_step > 0).all()


def test_fetch_changes_only_the_named_page(trace):
    """Oracle at a budget of one page: that page joins the kept set, nothing else changes."""
    pol = _policy("topk")
    page, a = 4, 0
    _, kept = event_inclusion(trace, pol, 0, 2)
    qi = [i for i, r in enumerate(trace.query_roles) if r == "decode"][a]
    t = int(trace.query_positions[qi])

    def softmax(h):
        g = h // trace.group_size
        s = trace.keys[g, :t + 1] @ trace.queries[h, qi] * trace.scale
        w = np.exp(s - s.max())
        return w / w.sum()

    # the (KV head, page) with the largest true mass, summed over the group, at step 0
    masses = {}
    for h in range(trace.n_heads):
        g = h // trace.group_size
        w = softmax(h)
        for p in np.flatnonzero(~kept[g, :t + 1]):
            masses[(g, p // page)] = masses.get((g, p // page), 0.0) + w[p]
    g_best, best = max(masses, key=masses.get)
    n_tok = np.count_nonzero(~kept[g_best][best * page:(best + 1) * page])
    total = sum(np.count_nonzero(~kept[x]) for x in range(trace.n_kv_heads))
    cols = _frame(simulate_layer(trace, pol, np.arange(1), 2, MemoryModel(page=page),
                                 ("oracle",), np.array([n_tok / total])))
    step0 = cols[cols.step == a]
    for h in range(trace.n_heads):
        g = h // trace.group_size
        row = step0[step0["head"] == h].iloc[0]
        assert row.pages_fetched == (1 if g == g_best else 0)
        keep = kept[g, :t + 1].copy()
        if g == g_best:
            keep[best * page:(best + 1) * page] = True
        w = softmax(h)
        V = trace.values[g, :t + 1]
        est = (w[keep] @ V[keep]) / w[keep].sum()
        assert row.err2_after == pytest.approx(((est - w @ V) ** 2).sum(), rel=1e-9)
        if g != g_best:
            assert row.err2_after == row.err2_before
        else:
            assert row.err2_after < row.err2_before


def test_confidence_weights_average_one():
    w = confidence_weights(np.array([-0.01, -2.0, np.nan, -0.5]))
    assert w.mean() == pytest.approx(1.0)
    assert w[1] > w[3] > w[0]
    assert np.all(confidence_weights(np.zeros(3)) == 1.0)


def test_run_resumes_locks_and_cli(tmp_path, capsys):
    build_store(tmp_path / "store", n_seqs=2, n_layers=2, o_proj=False)
    spec_path = tmp_path / "tiers.yaml"
    spec_path.write_text(
        "store: store\n"
        "grid: {score: [snapkv], design: [poisson], budget: [0.25], "
        "score_params: {'*': {window: 8}}}\n"
        "seeds: 2\nfetch_budgets: [0, 0.1, 1.0]\nmemory: {page: 4}\n")
    out = tmp_path / "out"
    assert main(["tiers", "--spec", str(spec_path), "--out", str(out), "--quiet"]) == 0
    t1 = pq.read_table(out / "tiers.parquet")
    assert t1.num_rows == 2 * 2 * 4 * 16 * len(SCHEDULERS) * 3   # seqs*layers*heads*steps*...
    assert t1.schema.field("err2_after").metadata[b"description"]
    assert t1.column("cert2").null_count == 0
    # resume: nothing recomputed, identical rows
    assert main(["tiers", "--spec", str(spec_path), "--out", str(out), "--quiet"]) == 0
    assert "2 parts resumed" in capsys.readouterr().out
    assert pq.read_table(out / "tiers.parquet").equals(t1)
    # a user error exits 2 with a message naming the field
    bad = tmp_path / "bad.yaml"
    bad.write_text("grid: {score: [snapkv], design: [poisson], budget: [0.25]}\n"
                   "memory: {tiers: [{name: dram, bandwidth_gbps: 0}]}\n")
    assert main(["tiers", "store", "--spec", str(bad), "--out", str(tmp_path / "o2")]) == 2
    assert "bandwidth_gbps" in capsys.readouterr().err
    # a second writer on the same output is refused
    from tracesim.atomic import DirLock
    with DirLock(out, "test"):
        assert main(["tiers", "--spec", str(spec_path), "--out", str(out), "--quiet"]) == 2
        assert "another tiers run" in capsys.readouterr().err


def test_analysis_curves_tests_and_figure(tmp_path):
    store = build_store(tmp_path / "store", n_seqs=3, n_layers=1, o_proj=False)
    from tracesim.store import open_store
    spec = parse_tiers_spec({"grid": GRID, "seeds": 2, "fetch_budgets": [0, 0.1, 0.5, 1.0],
                             "memory": {"page": 4}})
    run_tiers(spec, open_store(store), tmp_path / "out")
    df = pq.read_table(tmp_path / "out" / "tiers.parquet").to_pandas()
    curves = scheduler_curves(df)
    full = curves[curves.fetch_budget == 1.0]
    assert np.allclose(full[full.scheduler != "none"].recovered, 1.0)
    assert np.allclose(curves[curves.fetch_budget == 0].recovered, 0.0)
    oracle = curves[(curves.scheduler == "oracle") & (curves.fetch_budget == 0.1)]
    rnd = curves[(curves.scheduler == "random") & (curves.fetch_budget == 0.1)]
    assert oracle.recovered.mean() >= rnd.recovered.mean()
    table = compare_schedulers(curves, "oracle", ("random",))
    assert set(table.fetch_budget) == {0.1, 0.5}
    assert table.p_holm.between(0, 1).all()
    # 3 sequences: the exact sign-flip p-value cannot go below 1/8
    assert table.p_perm.min() >= 1 / 8 - 1e-12
    png = tiers_figure(curves, tmp_path / "tiers.png")
    assert png[:4] == b"\x89PNG" and (tmp_path / "tiers.png").stat().st_size == len(png)
    # the report carries the tables and the figure with --tiers
    from pathlib import Path

    from tracesim.analysis.report import build_report
    prereg = Path(__file__).resolve().parents[1] / "data" / "prereg.yaml"
    report = build_report(None, None, prereg_path=prereg, tiers_dir=tmp_path / "out")
    assert "tiers" in report.figures
    assert any("paired tests" in k for k in report.tables)
    with pytest.raises(ValueError, match="no tiers.parquet"):
        build_report(None, None, prereg_path=prereg, tiers_dir=tmp_path)
    assert math.isfinite(curves.recovered_per_gb.dropna().iloc[0])


def test_dask_backend_gives_identical_rows(tmp_path):
    store = build_store(tmp_path / "store", n_seqs=2, n_layers=1, o_proj=False)
    from tracesim.store import open_store
    spec = parse_tiers_spec({"grid": GRID, "seeds": 2, "fetch_budgets": [0, 0.1, 1.0],
                             "memory": {"page": 4}})
    run_tiers(spec, open_store(store), tmp_path / "local")
    run_tiers(spec, open_store(store), tmp_path / "dask", backend="dask", workers=2)
    a = pq.read_table(tmp_path / "local" / "tiers.parquet")
    b = pq.read_table(tmp_path / "dask" / "tiers.parquet")
    assert a.num_rows > 0 and a.equals(b)
