"""The compiled tiers simulator against its plain-numpy reference, column by column."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numba
import numpy as np
import pytest

from tests.replay_fixtures import synthetic_trace
from tracesim.kernels import tiers as kt
from tracesim.policies import policy_grid
from tracesim.replay import load_layer
from tracesim.store import open_store
from tracesim.synth import SynthConfig, write_synthetic_store
from tracesim.tiers import SCHEDULERS, MemoryModel, simulate_layer
from tracesim.tiers.reference import simulate_layer_reference

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample-traces"
BUDGETS = np.array([0.0, 0.02, 0.1, 0.5, 1.0])
UNCERTIFIED = tuple(s for s in SCHEDULERS if not s.startswith("certificate"))
#: Columns that must agree bit for bit: the same pages are chosen, the bytes are whole tokens.
EXACT = {"head", "kv_head", "step", "query_position", "fetch_budget", "n_seeds",
         "kv_bytes_moved", "bytes_moved", "pages_fetched", "evicted_bytes", "fetch_ms",
         "stall_ms"}


def _policy(design: str = "poisson", correction: str = "auto", window: int = 8):
    return policy_grid(["snapkv"], [design], [0.25], correction=correction,
                       score_params={"snapkv": {"window": window}},
                       design_params={"poisson": {"mixture": 0.1}})[0]


def _assert_same(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    for k, r in ref.items():
        g = np.asarray(got[k])
        r = np.asarray(r)
        assert g.shape == r.shape, k
        if r.dtype == object:
            assert (g == r).all(), k
        elif k in EXACT or k.startswith("bytes_"):
            np.testing.assert_array_equal(g, r, err_msg=k)
        else:
            scale = np.nanmax(np.abs(r)) if np.isfinite(r).any() else 0.0
            np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-10 * scale, err_msg=k)


def _both(trace, policy, seeds, memory, schedulers=SCHEDULERS, budgets=BUDGETS, n_layers=2):
    args = (trace, policy, np.asarray(seeds), n_layers, memory, schedulers, budgets)
    got = simulate_layer(*args)
    _assert_same(got, simulate_layer_reference(*args))
    return got


def test_scheduler_codes_follow_the_scheduler_names():
    assert [kt.S_NONE, kt.S_RANDOM, kt.S_CONFIDENCE, kt.S_CERTIFICATE, kt.S_CERTIFICATE_PAGE,
            kt.S_BOUND, kt.S_ORACLE, kt.S_CERTIFICATE_BOUND] == [SCHEDULERS.index(s) for s in (
                "none", "random", "confidence", "certificate", "certificate_page", "bound",
                "oracle", "certificate_bound")]


@pytest.mark.parametrize("page", [1, 4, 16])
def test_kernel_matches_reference_certified(page):
    trace = synthetic_trace(3, n_heads=4, n_kv=2, d=8, P=96, prompt_length=80)
    got = _both(trace, _policy(), np.arange(3), MemoryModel(page=page))
    # not vacuous: fetching changes the error, and some budgets stop short of every page
    mid = (got["fetch_budget"] == 0.1) & (got["scheduler"] == "oracle")
    assert (got["err2_after"][mid] < got["err2_before"][mid]).any()
    assert (got["kv_bytes_moved"][mid] < got["evicted_bytes"][mid]).all()


@pytest.mark.parametrize("design,correction", [("topk", "auto"), ("poisson", "none")])
def test_kernel_matches_reference_uncertified(design, correction):
    """Top-k (no sampled tokens) and Poisson without the Hájek weights (sampled tokens count
    once, no adjustment when their page is fetched)."""
    trace = synthetic_trace(5, n_heads=6, n_kv=2, d=8, P=96, prompt_length=80)
    pol = _policy(design, correction)
    assert not pol.certified
    _both(trace, pol, np.arange(2), MemoryModel(page=4, overlap=True), UNCERTIFIED)


def test_kernel_matches_reference_when_pages_are_not_yet_visible():
    """Decode-role queries inside the prompt see only some evicted pages (and pages cut at
    their position): the visible pages and the page bytes follow the reference."""
    trace = synthetic_trace(4, n_heads=4, n_kv=2, d=8, P=96, prompt_length=80)
    extra = [i for i, p in enumerate(trace.query_positions) if 60 <= p < 64]
    assert extra
    idx = np.r_[np.arange(trace.query_positions.size), extra]
    trace = dataclasses.replace(
        trace, queries=trace.queries[:, idx], outputs=trace.outputs[:, idx],
        query_positions=trace.query_positions[idx],
        query_roles=list(trace.query_roles) + ["decode"] * len(extra))
    got = _both(trace, _policy(), np.arange(2), MemoryModel(page=8))
    early = got["query_position"] < 64
    assert early.any()
    assert got["evicted_bytes"][early].max() < got["evicted_bytes"][~early].max()


def test_kernel_matches_reference_on_a_synthetic_store(tmp_path):
    cfg = SynthConfig(positions=300, layers=1, decode=12, window=8, question=12,
                      h2o_queries=64, dtype="float32", seed=11)
    store = open_store(write_synthetic_store(tmp_path / "s", cfg))
    seq = store[store.sequence_ids[0]]
    trace = load_layer(store, seq, 0)
    seq.close()
    _both(trace, _policy(), np.arange(2), MemoryModel(page=16), n_layers=30)


@pytest.mark.skipif(not SAMPLE.is_dir(), reason="data/sample-traces not present")
def test_kernel_matches_reference_on_the_sample_traces():
    store = open_store(SAMPLE)
    sid = store.sequence_ids[0]
    seq = store[sid]
    trace = load_layer(store, seq, 10)
    seq.close()
    _both(trace, _policy(), np.arange(2), MemoryModel(page=8),
          n_layers=store.model.n_layers)


def test_parallel_kernel_is_identical_for_any_thread_count(monkeypatch):
    trace = synthetic_trace(6, n_heads=4, n_kv=2, d=8, P=96, prompt_length=80)
    args = (trace, _policy(), np.arange(2), 2, MemoryModel(page=4), SCHEDULERS, BUDGETS)
    serial = simulate_layer(*args)
    monkeypatch.setattr(kt, "SERIAL_BELOW", 0)           # the parallel kernel on a small layer
    n_max = numba.config.NUMBA_NUM_THREADS
    runs = []
    for n in sorted({1, n_max}):
        numba.set_num_threads(n)
        try:
            runs.append(simulate_layer(*args))
        finally:
            numba.set_num_threads(n_max)
    for run in runs:
        for k, v in serial.items():
            np.testing.assert_array_equal(np.asarray(run[k]), np.asarray(v), err_msg=k)
