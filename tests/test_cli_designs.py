"""The command line reaches every design: ``--proxy``, ``--gqa``, ``--score-params`` and
``--design-params`` mean what a sweep spec's grid means, the summary names the proxy and whether
it is deployable, bad values exit 2 naming the option, and ``peers``/``evict`` share one name
for the peers' parameters."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.replay_fixtures import build_store
from tracesim.app.cli import build_parser
from tracesim.app.cli import main as cli_main
from tracesim.errors import UsageError
from tracesim.policies.cli_grid import overlay_options
from tracesim.policies.grid import expand_grid
from tracesim.replay.cli import build_policies


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return build_store(tmp_path_factory.mktemp("designs") / "store", n_seqs=1, n_layers=1,
                       P=72, prompt_length=60)


def _replay_args(*argv: str) -> argparse.Namespace:
    return build_parser("replay").parse_args(["replay", "STORE", "--out", "o", *argv])


def test_options_expand_as_the_spec_grid_does():
    args = _replay_args("--score", "perstep", "--design", "topk,poisson", "--schedule", "step",
                        "--budget", "0.25,64", "--proxy", "quant:4", "--gqa", "max",
                        "--design-params", '{"poisson": {"mixture": [0, 0.1]}}')
    grid = {"score": "perstep", "design": ["topk", "poisson"], "schedule": "step",
            "budget": [0.25, 64], "score_params": {"perstep": {"proxy": "quant:4", "gqa": "max"}},
            "design_params": {"poisson": {"mixture": [0, 0.1]}}}
    ids = [p.id for p in build_policies(args)]
    assert ids == [p.id for p in expand_grid(grid).policies] and len(ids) == 6
    assert all("quant:4" in i and "gqa=max" in i for i in ids)
    # the general JSON spelling of the same proxy gives the same configurations
    same = _replay_args("--score", "perstep", "--design", "topk,poisson", "--schedule", "step",
                        "--budget", "0.25,64", "--score-params",
                        '{"perstep": {"proxy": "quant:4", "gqa": "max"}}',
                        "--design-params", '{"poisson": {"mixture": [0, 0.1]}}')
    assert [p.id for p in build_policies(same)] == ids


@pytest.mark.parametrize("argv, option", [
    (["--score", "perstep", "--schedule", "step", "--proxy", "quant:99"], "--proxy"),
    (["--score", "perstep", "--schedule", "step", "--proxy", "nope"], "--proxy"),
    (["--score", "snapkv", "--proxy", "quant:4"], "--proxy"),
    (["--score", "snapkv", "--gqa", "max"], "--gqa"),
    (["--score", "perstep", "--schedule", "step", "--score-params", '{"perstep": {"x": 1}}'],
     "--score-params: perstep.x"),
    (["--score", "perstep", "--schedule", "step", "--score-params", "[1]"], "--score-params"),
    (["--score", "perstep", "--schedule", "step", "--score-params", "{"], "--score-params"),
    (["--design", "poisson", "--design-params", '{"poisson": {"mixture": 2}}'],
     "--design-params"),
    (["--design", "topk", "--design-params", '{"poisson": {"mixture": 0.1}}'],
     "--design-params"),
    (["--score", "perstep", "--schedule", "step", "--proxy", "quant:4", "--score-params",
      '{"perstep": {"proxy": "exact"}}'], "--proxy"),
])
def test_bad_values_exit_2_naming_the_option(store_path, tmp_path, capsys, argv, option):
    code = cli_main(["replay", str(store_path), "--out", str(tmp_path / "o"), "--no-progress",
                     *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert option in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_replay_summary_names_the_proxy_and_marks_what_is_not_deployable(store_path, tmp_path,
                                                                         capsys):
    code = cli_main(["replay", str(store_path), "--score", "perstep", "--design", "poisson",
                     "--schedule", "step", "--proxy", "quant:4", "--budget", "40", "--seeds",
                     "2", "--window", "4", "--no-progress", "--no-output-space",
                     "--out", str(tmp_path / "q")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "quant:4 (deployable)" in captured.out
    assert "per-step score: proxy quant:4 (deployable)" in captured.err
    configs = json.loads((tmp_path / "q" / "results" / "configs.json").read_text())
    assert [c["score"]["proxy"] for c in configs] == ["quant:4"]
    # the default proxy is printed as what it is
    code = cli_main(["replay", str(store_path), "--score", "perstep", "--design", "poisson",
                     "--schedule", "step", "--budget", "40", "--seeds", "2", "--window", "4",
                     "--no-progress", "--no-output-space", "--out", str(tmp_path / "e")])
    captured = capsys.readouterr()
    assert code == 0 and "exact (not deployable)" in captured.out
    assert "proxy exact (not deployable)" in captured.err and "mixture 0.0" in captured.err


def _evict_args(*argv: str) -> argparse.Namespace:
    return build_parser("evict").parse_args(["evict", "STORE", "--grid", "g.yaml", *argv])


def test_evict_options_lay_over_the_grid_file():
    grid = [{"score": ["perstep"], "design": "poisson", "schedule": "step", "budget": 0.25,
             "score_params": {"perstep": {"proxy": "exact", "top_fraction": 0.25}}},
            {"score": "snapkv", "design": "topk", "budget": 0.25}]
    out = overlay_options(grid, _evict_args("--proxy", "quant:4", "--design-params",
                                            '{"poisson": {"mixture": 0.1}}'))
    assert out[0]["score_params"] == {"perstep": {"proxy": "quant:4", "top_fraction": 0.25}}
    assert out[0]["design_params"] == {"poisson": {"mixture": 0.1}}
    assert out[1] == grid[1] and grid[0]["score_params"]["perstep"]["proxy"] == "exact"
    with pytest.raises(UsageError, match="--score-params: 'h2o' is not a score"):
        overlay_options(grid, _evict_args("--score-params", '{"h2o": {"window": 4}}'))
    with pytest.raises(UsageError, match="--proxy"):
        overlay_options(grid[1], _evict_args("--proxy", "quant:4"))


def test_one_name_for_the_peers_parameters():
    peers = build_parser("peers").parse_args(
        ["peers", "S", "--out", "o", "--peer-params", '{"quest": {"budget": 64}}'])
    alias = build_parser("peers").parse_args(
        ["peers", "S", "--out", "o", "--params", '{"quest": {"budget": 64}}'])
    evict = _evict_args("--peer", "quest", "--peer-params", '{"quest": {"budget": 64}}')
    assert peers.params == alias.params == evict.peer_params
