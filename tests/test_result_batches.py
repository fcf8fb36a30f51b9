"""Replay result batches: several layers' rows in one Arrow batch, run-length columns, and the
o_proj Gram blocks shared between the replays of one store."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from tests.replay_fixtures import build_store, synthetic_trace
from tracesim.columns import strings_from_runs
from tracesim.policies import make_policy
from tracesim.replay import ReplayOptions, iter_replay, layer_batch, replay, replay_layer
from tracesim.replay.results import columns_batch, layer_columns

SNAPKV = {"window": 8, "sinks": 2}  # the fixtures store 8 question-window queries
POLICIES = [make_policy("snapkv", "poisson", 0.25, correction="hajek", score_params=SNAPKV),
            make_policy("snapkv", "topk", 0.25, score_params=SNAPKV),
            make_policy("h2o", "bernoulli", 0.5, correction="hajek")]


def _results() -> list:
    seeds = np.arange(3)
    return [replay_layer(synthetic_trace(seed), POLICIES, seeds, 2,
                         ReplayOptions(output_space=True)) for seed in (0, 1)]


def test_layers_in_one_batch_equal_their_own_batches_and_the_seed_rows_they_aggregate():
    results = _results()
    for per_seed in (False, True):
        joined = pa.Table.from_batches([columns_batch([layer_columns(r, per_seed)
                                                      for r in results])])
        alone = pa.Table.from_batches([layer_batch(r, per_seed) for r in results])
        assert joined.schema.equals(alone.schema, check_metadata=True)
        assert joined.equals(alone)
    agg = layer_batch(results[0]).to_pandas()
    rows = layer_batch(results[0], per_seed=True).to_pandas()
    # Deterministic policies: one iteration, seed null; seeded ones: every seed, seed set.
    topk = rows["design"] == "topk"
    assert rows.loc[topk, "seed"].isna().all() and rows.loc[~topk, "seed"].notna().all()
    assert sorted(rows.loc[~topk, "seed"].unique()) == [0, 1, 2]
    keys = ["config_id", "head", "query_index"]
    mean = rows.groupby(keys)["err2"].mean()
    sd = rows.groupby(keys)["err2"].std(ddof=1)
    agg = agg.set_index(keys)
    assert np.allclose(agg["err2"], mean.loc[agg.index], rtol=1e-12, atol=0)
    seeded = agg["n_seeds"] > 1
    assert np.allclose(agg.loc[seeded, "err2_sd"], sd.loc[agg.index[seeded]], rtol=1e-12)
    assert agg.loc[~seeded, "err2_sd"].isna().all()
    assert (agg.loc[seeded, "n_seeds"] == 3).all()


def test_strings_from_runs_equal_the_expanded_column_with_nulls():
    values, lengths = ["adakv", "", None, "adakv"], [2, 3, 1, 0]
    got = strings_from_runs("allocator", values, np.array(lengths))
    assert got.to_pylist() == ["adakv"] * 2 + [None] * 4  # "" is null in this column
    got = strings_from_runs("config_id", ["a", ""], np.array([1, 2]))
    assert got.to_pylist() == ["a", "", ""]


def test_replays_of_one_store_share_the_gram_blocks_and_give_the_same_rows(tmp_path):
    from tracesim.store import open_store

    store = open_store(build_store(tmp_path / "store", n_seqs=2, n_layers=2))
    first = replay(store, POLICIES[:1], seeds=2, progress=False)
    cache = store.gram_cache
    assert len(cache) == 2  # one per layer
    blocks = dict(cache)
    again = replay(store, POLICIES[:1], seeds=2, progress=False)
    assert all(cache[k] is blocks[k] for k in blocks)  # not recomputed
    assert first.equals(again)
    fresh = replay(open_store(store.path), POLICIES[:1], seeds=2, progress=False)
    assert fresh.equals(first)
    # One batch per sequence here (few rows), in layer order.
    batches = list(iter_replay(store, POLICIES[:1], seeds=2, progress=False))
    assert len(batches) == 2
    assert batches[0].column("layer").to_pylist() == sorted(batches[0].column("layer")
                                                            .to_pylist())
