"""Configurations a design makes identical are computed once; swallowed budgets are named."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from tests.replay_fixtures import build_store
from tracesim.app.cli import main as cli_main
from tracesim.policies import make_policy, policy_grid
from tracesim.policies.grid import BudgetWarning
from tracesim.policies.redundancy import budget_warnings, effective_key, merge_score_free
from tracesim.replay import replay
from tracesim.store import open_store
from tracesim.sweep import expand_grid

SP = {"window": 4, "sinks": 2}


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return build_store(tmp_path_factory.mktemp("equiv") / "store", n_layers=1)


def test_bernoulli_rows_do_not_depend_on_the_score(store_path):
    """Ground truth for the merge: the rows of the merged configurations are identical."""
    store = open_store(store_path)
    pols = [make_policy(s, "bernoulli", 0.4, score_params=SP) for s in ("snapkv", "h2o", "tova")]
    pols.append(make_policy("h2o", "poisson", 0.4, score_params=SP,
                            design_params={"mixture": 1.0}))
    keys = {effective_key(p) for p in pols}
    assert len(keys) == 2  # bernoulli, and poisson with mixture 1 (its own design label)
    df = replay(store, pols, seeds=3, progress=False).to_pandas()
    cols = ["err2", "cert2", "wald_cov", "kept_tokens", "tail_size"]
    ref = df[df["score"] == "snapkv"].sort_values(["sequence_id", "head", "query_position"])
    for s in ("h2o", "tova"):
        other = df[(df["score"] == s) & (df["design"] == "bernoulli")].sort_values(
            ["sequence_id", "head", "query_position"])
        for c in cols:
            np.testing.assert_array_equal(ref[c].to_numpy(), other[c].to_numpy())
    # A score-dependent design differs (the check above can fail).
    pps = replay(store, [make_policy("h2o", "poisson", 0.4, score_params=SP)], seeds=3,
                 progress=False).to_pandas().sort_values(["sequence_id", "head",
                                                          "query_position"])
    assert not np.array_equal(ref["err2"].to_numpy(), pps["err2"].to_numpy())


def test_merge_keeps_what_the_score_still_decides():
    same = [make_policy(s, "bernoulli", 0.25, score_params=SP) for s in ("snapkv", "h2o")]
    kept, notes = merge_score_free(same)
    assert [p.score.name for p in kept] == ["snapkv"] and len(notes) == 1
    assert "bernoulli ignores the score: h2o" in notes[0]
    distinct = [
        make_policy("snapkv", "bernoulli", 0.25, score_params=SP),
        make_policy("h2o", "bernoulli", 0.25, score_params={"window": 5, "sinks": 2}),
        make_policy("vnorm", "bernoulli", 0.25, score_params=SP),  # top_fraction 0.5
        make_policy("snapkv", "bernoulli", 0.25, score_params={**SP, "question_aware": False}),
        make_policy("random", "bernoulli", 0.25, score_params=SP),  # correction none
        make_policy("snapkv", "topk", 0.25, score_params=SP),
        make_policy("h2o", "topk", 0.25, score_params=SP),
    ]
    kept, notes = merge_score_free(distinct)
    assert len(kept) == len(distinct) and notes == []


def test_grid_expansion_and_policy_grid_merge_once():
    grid = {"score": ["snapkv", "h2o", "streaming"], "design": ["bernoulli", "topk"],
            "budget": [0.25, 0.5], "score_params": {"*": SP}}
    e = expand_grid(grid)
    bern = [p for p in e.policies if p.design.name == "bernoulli"]
    assert len(bern) == 2 and {p.score.name for p in bern} == {"snapkv"}
    assert len(e.policies) == 2 + 3 * 2
    assert sum("ignores the score" in s for s in e.skipped) == 2
    pols = policy_grid(["snapkv", "h2o"], ["bernoulli"], [0.25], score_params={
        "snapkv": SP, "h2o": SP})
    assert len(pols) == 1
    assert len(policy_grid(["snapkv", "h2o"], ["bernoulli"], [0.25], merge=False)) == 2


def test_budget_below_sinks_and_window_warns_with_the_effective_budget():
    p = make_policy("snapkv", "poisson", 10, score_params={"sinks": 4, "window": 32})
    (msg,) = budget_warnings([p])
    assert "10 token(s)" in msg and "4 + 32" in msg and "effective budget is 36 tokens" in msg
    frac = make_policy("h2o", "poisson", 0.1, score_params={"sinks": 4, "window": 32})
    assert budget_warnings([frac]) == []  # fractions need the context length
    (msg,) = budget_warnings([frac], contexts=[125, 300])
    assert "12 token(s) at the shortest context (125 tokens)" in msg
    assert "effective budget is 36 tokens" in msg
    assert budget_warnings([frac], contexts=[400]) == []
    with pytest.warns(BudgetWarning, match="effective budget is 36 tokens"):
        expand_grid({"score": "snapkv", "design": "poisson", "budget": 10,
                     "score_params": {"snapkv": {"window": 32}}})
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        expand_grid({"score": "snapkv", "design": "poisson", "budget": 64})


def test_replay_cli_prints_the_warning_and_the_merge(store_path, tmp_path, capsys):
    rc = cli_main(["replay", str(store_path), "--score", "snapkv,h2o", "--design", "bernoulli",
                   "--budget", "2", "--window", "4", "--seeds", "2", "--layers", "0",
                   "--no-progress", "--out", str(tmp_path / "r")])
    assert rc == 0
    err = capsys.readouterr().err
    assert "warning: budget uniform:2tok is 2 token(s)" in err
    assert "effective budget is" in err
    assert "note: bernoulli ignores the score: h2o" in err


def test_sweep_dry_run_prints_the_warning_and_lists_the_merge(tmp_path, capsys):
    import yaml

    from tests.sweep_fixtures import SPEC_TEXT, build_sweep_store

    build_sweep_store(tmp_path / "store", n_seqs=1, n_layers=1)
    doc = yaml.safe_load(SPEC_TEXT)
    doc["grid"] = {"score": ["snapkv", "h2o"], "design": ["bernoulli"], "budget": [0.5, 5],
                   "score_params": {"*": {"window": 6}}}
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc))
    assert cli_main(["sweep", str(spec), "--dry-run", "--no-calibrate"]) == 0
    out, err = capsys.readouterr()
    assert "tracesim sweep: warning:" in err and "effective budget is 10 tokens" in err
    assert "skipped: bernoulli ignores the score: h2o" in out
    assert "grid: 2 configuration(s)" in out


def test_uses_scores_merges_what_the_old_rule_merged():
    """``Design.uses_scores`` replaced ``isinstance(d, Bernoulli) or d.mixture == 1``: the same
    built-in designs ignore the score, so the same configurations merge."""
    from tracesim.designs import Bernoulli, OrderSampling, PoissonPPS, TopK
    from tracesim.policies.redundancy import design_ignores_score

    designs = [Bernoulli(), TopK()]
    for mixture in (0.0, 0.1, 0.5, 0.999, 1.0, 1):
        for floor in (0.0, 0.05):
            designs.append(PoissonPPS(mixture=mixture, floor=floor))
            designs += [OrderSampling(kind=k, mixture=mixture, floor=floor)
                        for k in ("pareto", "sequential")]
    for d in designs:
        old = isinstance(d, Bernoulli) or float(getattr(d, "mixture", 0.0)) == 1.0
        assert design_ignores_score(d) is old and d.uses_scores is not old, d
    assert design_ignores_score(None) is False
    grid = {"score": ["snapkv", "h2o", "tova"], "design": ["bernoulli", "poisson", "fixed",
                                                           "topk"],
            "budget": [0.25, 8], "score_params": {"*": SP},
            "design_params": {"poisson": {"mixture": [0.0, 1.0]},
                              "fixed": {"mixture": [0.5, 1.0], "kind": ["pareto",
                                                                        "sequential"]}}}
    e = expand_grid(grid)
    merged = {(p.design.name, p.design.params_json()) for p in e.policies
              if p.score.name != "snapkv"}
    assert merged == {("poisson", '{"floor": 0.0, "mixture": 0.0}'),
                      ("fixed", '{"floor": 0.0, "kind": "pareto", "mixture": 0.5}'),
                      ("fixed", '{"floor": 0.0, "kind": "sequential", "mixture": 0.5}'),
                      ("topk", "{}")}
    # per budget: bernoulli 1, poisson 3 + 1, fixed 2 x 3 + 2 x 1, topk 3
    assert len(e.policies) == 2 * (1 + 3 + 1 + 2 * 3 + 2 + 3)


def test_a_plugin_design_that_ignores_the_score_is_merged_too():
    from dataclasses import dataclass
    from typing import ClassVar

    from tracesim.designs import Design
    from tracesim.plugins import register_design
    from tracesim.registry import DESIGN_REGISTRY

    @dataclass(frozen=True)
    class Flat(Design):
        name: ClassVar[str] = "test_flat_merged"
        uses_scores: ClassVar[bool] = False

        def inclusion_probabilities(self, scores, n):
            return np.full(len(scores), n / len(scores))

    register_design(Flat)
    try:
        pols = policy_grid(["snapkv", "h2o"], ["test_flat_merged"], [0.25],
                           score_params={"snapkv": SP, "h2o": SP})
        assert [p.score.name for p in pols] == ["snapkv"]
        assert len(policy_grid(["snapkv", "h2o"], ["test_flat_merged"], [0.25],
                               score_params={"snapkv": SP, "h2o": SP}, merge=False)) == 2
    finally:
        DESIGN_REGISTRY.registered.pop("test_flat_merged", None)
        DESIGN_REGISTRY.loaded_hash.pop("test_flat_merged", None)
