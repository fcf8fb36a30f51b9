"""Sweep specs and grids: expansion, validation errors naming the key, planning, dry run."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.sweep_fixtures import SPEC_TEXT, build_sweep_store
from tracesim.app.cli import main as cli_main
from tracesim.policies import policy_grid
from tracesim.sweep import SpecError, expand_grid, load_spec, parse_grid, parse_spec, plan_tasks


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweepspec")
    build_sweep_store(root / "store")
    return root


def write_spec(root, text=SPEC_TEXT, name="spec.yaml", **overrides):
    doc = yaml.safe_load(text)
    doc.update(overrides)
    path = root / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_grid_expansion_counts_dedup_and_params():
    pols = parse_grid({"score": ["snapkv", "h2o", "full"], "design": ["topk", "poisson"],
                       "budget": [0.25, 0.5, 512], "allocator": ["uniform", "adakv"],
                       "schedule": ["oneshot", "decode:8"]})
    assert len(pols) == 2 * 2 * 3 * 2 * 2 + 1
    assert sum(p.id == "full" for p in pols) == 1
    assert len({p.id for p in pols}) == len(pols)
    tokens = [p for p in pols if p.budget is not None and p.budget.unit == "tokens"]
    assert tokens and all(p.budget.value == 512 for p in tokens)
    # Same ids as the replay CLI's grid builder for the common part.
    ref = policy_grid(["snapkv"], ["topk", "poisson"], [0.25])
    got = parse_grid({"score": "snapkv", "design": ["topk", "poisson"], "budget": 0.25})
    assert [p.id for p in got] == [p.id for p in ref]
    # Hyperparameter lists are swept; '*' applies to every score that has the parameter.
    sp = parse_grid({"score": ["snapkv", "streaming"], "design": "poisson", "budget": 0.5,
                     "score_params": {"*": {"sinks": 2}, "snapkv": {"window": [8, 16],
                                                                     "pooling": "max"}},
                     "design_params": {"poisson": {"mixture": [0.0, 0.2]}},
                     "allocator": ["uniform", "pyramidkv"],
                     "allocator_params": {"pyramidkv": {"beta": [10, 20]}}})
    snap = [p for p in sp if p.score.name == "snapkv"]
    assert len(snap) == 2 * 2 * 3 and {p.score.window for p in snap} == {8, 16}
    assert all(p.score.sinks == 2 and p.score.pooling == "max" for p in snap)
    assert all(p.score.sinks == 2 for p in sp)
    assert {p.budget.beta for p in sp if p.budget.allocator == "pyramidkv"} == {10.0, 20.0}
    # A union of grids; fixed-size x decode combinations are skipped and reported.
    ex = expand_grid([{"score": "h2o", "design": ["fixed", "topk"], "budget": 0.5,
                       "schedule": ["oneshot", "decode"]},
                      {"score": "h2o", "design": "topk", "budget": 0.5}])
    assert len(ex.policies) == 3 and len(ex.skipped) == 1 and "fixed" in ex.skipped[0]
    assert [p.id for p in parse_grid({"score": "full"})] == ["full"]


@pytest.mark.parametrize("grid, where, words", [
    ({"score": ["snapkv"], "design": "topk", "budget": [0.25, 1.5]}, "grid.budget[1]",
     "1.5 is not a fraction in (0, 1] — give token budgets as integers >= 1"),
    ({"score": ["snapkv", "h2oo"], "design": "topk", "budget": 0.5}, "grid.score[1]",
     "unknown score 'h2oo'"),
    ({}, "grid", "is empty"),
    ({"score": []}, "grid.score", "is empty"),
    ({"score": "snapkv", "design": "topk", "budget": 0.5, "budgets": [1]}, "grid.budgets",
     "unknown key"),
    ({"score": "snapkv", "design": "topk", "budget": "half"}, "grid.budget",
     "'half' is not a budget"),
    ({"score": "snapkv", "design": "topk", "budget": True}, "grid.budget", "not a budget"),
    ({"score": "snapkv", "design": "topk", "budget": 0}, "grid.budget", "not a token budget"),
    ({"score": "snapkv", "budget": 0.5}, "grid.design", "missing"),
    ({"score": "snapkv", "design": "topk", "budget": 0.5, "schedule": "decode:0"},
     "grid.schedule", "integer >= 1"),
    ({"score": "snapkv", "design": "topk", "budget": 0.5,
      "score_params": {"snapkv": {"window": "big"}}}, "grid.score_params.snapkv.window",
     "wrong type"),
    ({"score": "snapkv", "design": "topk", "budget": 0.5,
      "score_params": {"snapkv": {"windw": 3}}}, "grid.score_params.snapkv.windw",
     "unknown parameter"),
    ({"score": "snapkv", "design": "topk", "budget": 0.5,
      "score_params": {"h2o": {"window": 3}}}, "grid.score_params.h2o",
     "not in the grid's score list"),
    ({"score": "snapkv", "design": "topk", "budget": 0.5,
      "score_params": {"snapkv": {"kernel": 4}}}, "grid.score_params.snapkv", "odd"),
    ({"score": "snapkv", "design": "poisson", "budget": 0.5,
      "design_params": {"poisson": {"mixture": 2.0}}}, "grid.design_params.poisson",
     "mixture"),
    ({"score": "snapkv", "design": "topk", "budget": 0.5, "allocator": "adakv",
      "allocator_params": {"adakv": {"beta": 3}}}, "grid.allocator_params.adakv.beta",
     "unknown parameter"),
])
def test_bad_grids_name_the_key(grid, where, words):
    with pytest.raises(SpecError) as err:
        parse_grid(grid, where="spec.yaml: grid")
    msg = str(err.value)
    assert msg.startswith(f"spec.yaml: {where}:"), msg
    assert words in msg, msg


@pytest.mark.parametrize("override, key, words", [
    ({"grid": {"score": "snapkv", "design": "topk", "budget": [0.25, 1.5]}},
     "grid.budget[1]", "is not a fraction in (0, 1]"),
    ({"grid": {"score": "snapkv2", "design": "topk", "budget": 0.5}}, "grid.score",
     "unknown score"),
    ({"grid": {}}, "grid", "is empty"),
    ({"store": "no-such-store"}, "store", "cannot open trace store"),
    ({"stores": ["store"]}, "stores", "unknown key"),
    ({"seeds": "many"}, "seeds", "expected a number of seeds"),
    ({"seeds": [1, 1]}, "seeds", "repeat"),
    ({"layers": [0, 7]}, "layers", "layer 7 does not exist"),
    ({"layers": [0, "x"]}, "layers[1]", "expected an integer"),
    ({"record": "mean"}, "record", "expected 'aggregated' or 'per_seed'"),
    ({"options": {"output_space": "yes"}}, "options.output_space", "true or false"),
    ({"options": {"roles": ["decode", "prefill"]}}, "options.roles[1]", "unknown query role"),
    ({"sequences": {"ids": ["s0", "zz"]}}, "sequences.ids[1]", "no store has sequence 'zz'"),
    ({"sequences": {"tasks": ["gamma"]}}, "sequences", "selects no sequence"),
    ({"sequences": {"limit": 0}}, "sequences.limit", "expected an integer >= 1"),
    ({"partition": {"layers_per_task": 0}}, "partition.layers_per_task", "integer >= 1"),
    ({"prereg": "missing.yaml"}, "prereg", "not an existing file"),
])
def test_bad_specs_fail_before_any_work(store_dir, tmp_path, capsys, override, key, words):
    spec_path = write_spec(store_dir, name=f"bad-{key.replace('.', '_')}.yaml",
                           output=str(tmp_path / "out"), **override)
    with pytest.raises(SpecError) as err:
        load_spec(spec_path)
    msg = str(err.value)
    assert msg.startswith(f"{spec_path}: {key}:"), msg
    assert words in msg, msg
    # The CLI reports the same message, exits 2 and creates nothing.
    assert cli_main(["sweep", str(spec_path), "--no-progress"]) == 2
    assert f"{key}:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_yaml_is_data_only_and_top_level_errors(store_dir, tmp_path):
    evil = tmp_path / "evil.yaml"
    evil.write_text("store: !!python/object/apply:os.system ['touch pwned']\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(evil)
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(SpecError, match=r"<dict>: expected a mapping"):
        parse_spec([1, 2])
    with pytest.raises(SpecError, match=r"<dict>: grid: missing"):
        parse_spec({"store": str(store_dir / "store")})
    with pytest.raises(SpecError, match="cannot read the spec"):
        load_spec(tmp_path / "absent.yaml")


def test_spec_hash_plan_names_and_config_chunks(store_dir, tmp_path):
    spec = load_spec(write_spec(store_dir))
    assert spec.output == (store_dir / "out").resolve()
    assert len(spec.policies) == 4 * 2 * 3 * 2 + 1 and spec.seeds == (0, 1, 2)
    plan = plan_tasks(spec)
    assert len(plan.tasks) == 3 * 3 and plan.n_sequences == 3
    again = plan_tasks(load_spec(write_spec(store_dir)))
    assert [t.path for t in plan.tasks] == [t.path for t in again.tasks]
    assert all(t.path.startswith(f"tasks/store/{t.sequence_id}/L") for t in plan.tasks)
    # Output location and partition do not change the result hash; the grid does.
    moved = load_spec(write_spec(store_dir, output=str(tmp_path / "elsewhere")))
    assert moved.result_hash() == spec.result_hash()
    other = load_spec(write_spec(store_dir, seeds=4))
    assert other.result_hash() != spec.result_hash()
    # A small memory cap splits configurations into chunks covering each exactly once.
    small = load_spec(write_spec(store_dir, partition={"max_task_memory_mb": 16,
                                                       "layers_per_task": 2}))
    sp = plan_tasks(small)
    by_unit: dict = {}
    for t in sp.tasks:
        by_unit.setdefault((t.sequence_id, t.layers), []).append(t.configs)
    assert {len(layers) for _, layers in by_unit} == {1, 2}
    for chunks in by_unit.values():
        chunks.sort()
        assert chunks[0][0] == 0 and chunks[-1][1] == len(small.policies)
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))
    assert sum(t.rows for t in sp.tasks) == sum(t.rows for t in plan.tasks)
    # Sequence filter: tasks + limit.
    flt = load_spec(write_spec(store_dir, sequences={"tasks": ["alpha"], "limit": 1}))
    assert {t.sequence_id for t in plan_tasks(flt).tasks} == {"s0"}


def test_dry_run_prints_plan_and_runs_nothing(store_dir, tmp_path, capsys):
    spec_path = write_spec(store_dir, output=str(tmp_path / "dry"))
    assert cli_main(["sweep", str(spec_path), "--dry-run", "--workers", "2"]) == 0
    text = capsys.readouterr().out
    assert "tasks: 9" in text and "49 configuration(s)" in text
    assert "query-position evaluations" in text and "time: ~" in text
    assert "results/manifest.json" in text and "tasks/<store>/<sequence>/" in text
    assert not (tmp_path / "dry").exists()
    # The configs the workers will read survive their JSON round trip.
    spec = load_spec(spec_path)
    assert all(json.loads(p.to_json()) for p in spec.policies)


def test_score_and_design_options_from_a_grid():
    pols = parse_grid({"score": ["snapkv", "knorm", "oracle"], "design": "poisson",
                       "budget": 0.25, "schedule": "decode:4",
                       "score_params": {"snapkv": {"window_source": ["last", "question"],
                                                   "refresh": [False, True]},
                                        "knorm": {"refresh": True}},
                       "design_params": {"poisson": {"mixture": 0.1, "floor": [0.0, 0.05]}}})
    snap = [p for p in pols if p.score.name == "snapkv"]
    assert len(snap) == 2 * 2 * 2
    assert {(p.score.window_source, p.score.refresh) for p in snap} == {
        ("last", False), ("last", True), ("question", False), ("question", True)}
    assert all(p.score.refresh for p in pols if p.score.name == "knorm")
    assert {p.design.floor for p in pols} == {0.0, 0.05}
    assert {p.row()["floor"] for p in pols} == {0.0, 0.05}
    assert [p.row()["deployable"] for p in pols if p.score.name == "oracle"] == [False, False]


@pytest.mark.parametrize("params, where, words", [
    ({"design_params": {"poisson": {"floor": 1.0}}}, "grid.design_params.poisson",
     "PoissonPPS.floor = 1.0: expected a value in [0, 1)"),
    ({"design_params": {"poisson": {"floor": -0.1}}}, "grid.design_params.poisson",
     "PoissonPPS.floor"),
    ({"design_params": {"poisson": {"floor": "high"}}}, "grid.design_params.poisson.floor",
     "wrong type"),
    ({"score_params": {"snapkv": {"window_source": "first"}}}, "grid.score_params.snapkv",
     "SnapKVScore.window_source = 'first'"),
    ({"score_params": {"snapkv": {"refresh": 1}}}, "grid.score_params.snapkv.refresh",
     "wrong type"),
])
def test_bad_score_and_design_options_name_the_field(params, where, words):
    grid = {"score": "snapkv", "design": "poisson", "budget": 0.25, **params}
    with pytest.raises(SpecError) as err:
        parse_grid(grid, where="spec.yaml: grid")
    msg = str(err.value)
    assert msg.startswith(f"spec.yaml: {where}:") and words in msg, msg


def test_oracle_on_a_store_without_decode_queries_is_refused(tmp_path):
    build_sweep_store(tmp_path / "store", n_seqs=1, P=60, prompt=60)
    doc = {"store": "store", "grid": {"score": "oracle", "design": "poisson", "budget": 0.5}}
    with pytest.raises(SpecError, match=r"spec.yaml: grid.score: 'oracle' scores with the "
                                        r"decode queries, and sequence 's0'"):
        parse_spec(doc, source="spec.yaml", base_dir=tmp_path)
    doc["grid"]["score"] = "snapkv"
    doc["grid"]["score_params"] = {"snapkv": {"window": 6}}
    assert parse_spec(doc, source="spec.yaml", base_dir=tmp_path).policies
