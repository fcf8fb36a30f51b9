"""The replay API on a store, the ``replay`` and ``adversary`` CLIs, and the C0 demo."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.replay_fixtures import build_store, synthetic_trace
from tracesim.adversary import impossibility_demo
from tracesim.app.cli import main as cli_main
from tracesim.dataset_read import read_results
from tracesim.policies import make_policy, policy_grid
from tracesim.replay import METRICS, RESULT_COLUMNS, replay
from tracesim.store import open_store


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return build_store(tmp_path_factory.mktemp("replay") / "store", n_layers=2)


def test_replay_api_rows_columns_and_per_seed(store_path):
    store = open_store(store_path)
    pols = policy_grid(["snapkv", "full"], ["topk", "poisson"], [0.4],
                       score_params={"snapkv": {"window": 8}})
    table = replay(store, pols, seeds=4, progress=False)
    assert table.column_names == list(RESULT_COLUMNS)
    assert set(METRICS) <= set(table.column_names)
    H, n_dec = store.model.n_heads, 16 + 16  # decode queries of the two sequences
    assert table.num_rows == len(pols) * H * n_dec * store.model.n_layers
    df = table.to_pandas()
    full = df[df["score"] == "full"]
    assert (full["err2"] == 0).all() and (full["layer_err2"] == 0).all()
    topk = df[df["design"] == "topk"]
    assert topk["cert2"].isna().all() and (topk["n_seeds"] == 1).all()
    pois = df[df["design"] == "poisson"]
    assert (pois["n_seeds"] == 4).all() and pois["cert2"].notna().all()
    assert (pois["output_check"] < 1e-5).all()  # float32 store: recomputation agrees
    per_seed = replay(store, pols, seeds=[7, 3], layers=[1], sequences=["seq1"],
                      per_seed=True, progress=False).to_pandas()
    sub = per_seed[per_seed["design"] == "poisson"]
    assert sorted(sub["seed"].unique()) == [3, 7]
    agg = replay(store, pols, seeds=[7, 3], layers=[1], sequences=["seq1"],
                 progress=False).to_pandas()
    a = agg[agg["design"] == "poisson"].sort_values(["head", "query_position"])
    b = sub.groupby(["head", "query_position"])["err2"].mean().reset_index()
    np.testing.assert_allclose(a["err2"].to_numpy(), b["err2"].to_numpy(), rtol=1e-12)
    with pytest.raises(ValueError):
        replay(store, pols, seeds=2, layers=[5], progress=False)
    # Any order of sequences and layers gives the same rows, bit for bit.
    again = replay(store, pols, seeds=4, layers=[1, 0], sequences=["seq1", "seq0"],
                   progress=False).to_pandas()
    keys = ["sequence_id", "layer", "config_id", "head", "query_position"]
    a = df.sort_values(keys).reset_index(drop=True)
    b = again.sort_values(keys).reset_index(drop=True)
    for col in ("err2", "cert2", "wald_cov", "layer_cert2", "tail_out_max"):
        np.testing.assert_array_equal(a[col].to_numpy(), b[col].to_numpy())


def test_replay_cli_writes_parquet_and_summary(store_path, tmp_path, capsys):
    out = tmp_path / "res"
    code = cli_main(["replay", str(store_path), "--score", "snapkv,h2o", "--design",
                     "topk,poisson", "--budget", "0.3,0.5", "--seeds", "3", "--window", "8",
                     "--no-progress", "--out", str(out)])
    assert code == 0
    table = read_results(out)
    assert len(set(table["config_id"].to_pylist())) == 8
    configs = json.loads((out / "results" / "configs.json").read_text())
    assert len(configs) == 8 and all("id" in c for c in configs)
    printed = capsys.readouterr().out
    assert "snapkv" in printed and "poisson" in printed and "rows" in printed
    assert cli_main(["replay", str(store_path), "--score", "nope", "--out", str(out)]) == 2


def test_impossibility_demo_topk_blind_poisson_sees():
    trace = synthetic_trace(8)
    table = impossibility_demo(trace, score="snapkv", budget=0.3, head=1, seeds=32,
                               grid=(0.0, 10.0, 1000.0), score_params={"window": 8})
    rows = table.to_pylist()
    assert all(r["topk_identical"] for r in rows)
    assert rows[2]["topk_err2"] > 1e3 * rows[0]["topk_err2"]
    assert rows[2]["poisson_cert2"] > 1e3 * max(rows[0]["poisson_cert2"], 1e-12)
    assert rows[2]["poisson_seeds_sampling_perturbed"] > 0


def test_adversary_cli(store_path, tmp_path, capsys):
    code = cli_main(["adversary", str(store_path), "--score", "h2o", "--budget", "0.3",
                     "--window", "8", "--seeds", "16", "--grid", "0,100", "--out",
                     str(tmp_path / "adv")])
    assert code == 0
    rows = json.loads((tmp_path / "adv" / "adversary.json").read_text())["rows"]
    assert rows[0]["topk_retained_hash"] == rows[1]["topk_retained_hash"]
    assert "identical for every t: True" in capsys.readouterr().out
    assert cli_main(["adversary", str(store_path), "--head", "99", "--out",
                     str(tmp_path / "x")]) == 2


def test_vnorm_changes_the_retained_cache():
    # vnorm reads values, so perturbing evicted values changes what it keeps: no blindness.
    trace = synthetic_trace(9)
    table = impossibility_demo(trace, score="vnorm", budget=0.3, seeds=8, grid=(0.0, 100.0),
                               score_params={"window": 8})
    assert not table.column("topk_identical").to_pylist()[1]
    assert make_policy("vnorm", "topk", 0.3).score.top_fraction == 0.5


def test_replay_cli_floor_oracle_and_new_columns(store_path, tmp_path, capsys):
    out = tmp_path / "floor"
    code = cli_main(["replay", str(store_path), "--score", "oracle,snapkv", "--design",
                     "poisson", "--budget", "0.4", "--seeds", "2", "--window", "8",
                     "--mixture", "0.1", "--floor", "0.05", "--layers", "1",
                     "--no-progress", "--out", str(out)])
    assert code == 0
    configs = json.loads((out / "results" / "configs.json").read_text())
    assert {c["design"]["floor"] for c in configs} == {0.05}
    df = read_results(out).to_pandas()
    assert (df["floor"] == 0.05).all()
    assert dict(df.groupby("score")["deployable"].first()) == {"oracle": False, "snapkv": True}
    mtw = df["max_tail_weight"]
    assert mtw.notna().any() and ((mtw.dropna() > 0) & (mtw.dropna() <= 1)).all()
    capsys.readouterr()
    assert cli_main(["replay", str(store_path), "--design", "poisson", "--floor", "1.0",
                     "--out", str(tmp_path / "bad")]) == 2
    assert "--floor = 1.0: expected a value in [0, 1)" in capsys.readouterr().err
