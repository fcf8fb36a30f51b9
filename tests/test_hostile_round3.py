"""Round three of hostile input (issue #32), in-process: the size estimates, the layer parser,
the adversary and --traces checks of the report, and the tensor-index footer bound."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tracesim.errors import UsageError


def test_check_estimate_names_estimate_and_limit():
    from tracesim.sizes import check_estimate, human

    assert human(1536) == "1.5 KiB" and human(3 << 40) == "3.0 TiB"
    check_estimate(1 << 30, 1 << 30, "--x", "memory")  # at the limit: accepted
    with pytest.raises(UsageError, match=r"--x: needs about 2.0 GiB of memory, expected at "
                                         r"most 1.0 GiB"):
        check_estimate(2 << 30, 1 << 30, "--x", "memory")
    with pytest.raises(UsageError, match="needs about 11 rows of sequences, expected at most 10"):
        check_estimate(11, 10, "f", "sequences", unit="rows")


def test_synth_sizes_grow_with_every_factor():
    from tracesim.synth.store import SynthConfig, synth_sizes

    base = SynthConfig(positions=4096, layers=2, sequences=1)
    mem, written = synth_sizes(base)
    assert 0 < mem < 1 << 30 and written > 0
    for change in ({"positions": 8192}, {"layers": 4}, {"sequences": 2}):
        cfg = SynthConfig(**{"positions": 4096, "layers": 2, "sequences": 1, **change})
        assert synth_sizes(cfg)[1] > written
    # a layer of 4096 positions x 3 KV heads x d=64 in float16: keys and values alone
    assert mem >= 2 * 3 * 4096 * 64 * 2


def test_parse_layers_every_spelling():
    from tracesim.counts import parse_layers

    assert parse_layers("0:30:3", 30) == list(range(0, 30, 3))
    assert parse_layers(":", 3) == [0, 1, 2] and parse_layers("2,0", 3) == [2, 0]
    for text, word in (("0:100000000", "4096"), ("0:31", "31"), ("5,5", "repeats"),
                       ("0:4:0", "step"), ("1:2:3:4", "START:STOP:STEP"), ("x", "not an int"),
                       ("29,4095", "layer 4095"), ("3:3", "no layer"),
                       (",".join(["1"] * 5000), "4096")):
        with pytest.raises(UsageError, match=word):
            parse_layers(text, 30)


def test_peer_integers_and_names_bounded():
    from tracesim.peers import make_peer
    from tracesim.peers.cli import _peer_names

    for name, params in (("quest", {"page": 10**12}), ("magicpig", {"local": 10**30}),
                         ("vattention", {"sinks": 1 << 21})):
        with pytest.raises(ValueError, match="1048576"):
            make_peer(name, **params)
    assert make_peer("quest", page=1 << 20).page == 1 << 20
    with pytest.raises(ValueError, match="'quest' repeats"):
        _peer_names("quest, quest")
    assert _peer_names("quest,magicpig") == ["quest", "magicpig"]


def test_lowrank_refused_at_planning_by_head_dim():
    from tracesim.policies import Policy
    from tracesim.policies.grid import SpecError, expand_grid
    from tracesim.sweep.tasks import check_policies_fit

    grid = {"score": "perstep", "design": "poisson", "budget": 0.5, "schedule": "step",
            "score_params": {"perstep": {"proxy": ["lowrank:8", "lowrank:9"]}}}
    policies = expand_grid(grid, "grid").policies
    assert all(isinstance(p, Policy) for p in policies)
    with pytest.raises(SpecError, match=r"lowrank:9.*store 's'.*head_dim = 8"):
        check_policies_fit(policies, 8, "s")
    check_policies_fit(policies, 16, "s")


def test_adversary_rows_checked(tmp_path):
    from tracesim.analysis.verify_inputs import check_adversary

    good = {"rows": [{"t": 0, "topk_identical": True, "topk_err2": 0.1, "poisson_cert2": 0.2}]}
    check_adversary(good, tmp_path / "adversary.json")
    check_adversary({}, tmp_path / "adversary.json")  # no rows: C0 not evaluated
    for field, value, word in (("topk_err2", float("nan"), "finite"),
                               ("t", "7", "finite"), ("topk_identical", "yes", "true or false"),
                               ("poisson_cert2", math.inf, "finite")):
        doc = {"rows": [{**good["rows"][0], field: value}]}
        with pytest.raises(UsageError, match=rf"adversary.json: rows\[0\] field '{field}'.*"
                                              f"{word}"):
            check_adversary(doc, tmp_path / "adversary.json")
    with pytest.raises(UsageError, match="expected a list"):
        check_adversary({"rows": "x"}, tmp_path / "adversary.json")


def test_report_refuses_adversary_with_nan(tmp_path):
    """Through the report itself (JSON's NaN literal parses to a float NaN)."""
    from tracesim.analysis.report import build_report

    rows = [{"t": 0, "topk_identical": True, "topk_err2": 0.1, "poisson_cert2": 0.2},
            {"t": 1, "topk_identical": True, "topk_err2": float("nan"), "poisson_cert2": 0.3}]
    (tmp_path / "adversary.json").write_text(json.dumps({"rows": rows}))
    with pytest.raises(UsageError, match=r"rows\[1\] field 'topk_err2' is nan"):
        build_report(None, None, prereg_path="data/prereg.yaml", adversary_dir=tmp_path)


def test_manifest_footer_bounds_every_reader(tmp_path):
    from tests.replay_fixtures import build_store
    from tracesim.store import StoreError, open_store, validate_store

    store = build_store(tmp_path / "s", n_seqs=1, n_layers=1, n_heads=2, n_kv=1, d=8)
    ids = pa.array(["s"] * 100_001).dictionary_encode()
    pq.write_table(pa.table({"sequence_id": ids}), store / "manifest.parquet")
    with pytest.raises(StoreError, match="manifest.parquet: needs about 100001 rows"):
        open_store(store)
    problems = validate_store(store, check_data=False)
    assert len(problems) == 1 and "100001 rows" in problems[0] and "100000" in problems[0]


def test_tensor_index_footer_bounded(tmp_path):
    from tracesim.store import StoreError
    from tracesim.store.tensorfile import TensorFile, write_tensor_file

    path = tmp_path / "t.arrow"
    write_tensor_file(path, {"k/0/0": np.zeros((2, 3), np.float16)}, "t.arrow")
    assert TensorFile(path, "t.arrow").index
    with pa.memory_map(str(path)) as src:
        table = pa.ipc.open_file(src).read_all()
    meta = {**table.schema.metadata, b"pad": b"x" * (17 << 20)}
    big = table.replace_schema_metadata(meta)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, big.schema) as writer:
        writer.write_table(big)
    with pytest.raises(StoreError, match=r"t.arrow: index \(Arrow footer\): needs about 17.0 "
                                         r"MiB .* expected at most 16.0 MiB"):
        TensorFile(path, "t.arrow")
