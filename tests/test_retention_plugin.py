"""The Make-Each-Token-Count plugin example (docs/examples/retention_score.py): a per-token
retention file, validated, ranked by a loop reference; bad files exit 2 naming file and field."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.replay_fixtures import build_store, synthetic_trace
from tracesim.app.cli import main as cli_main
from tracesim.policies import make_policy
from tracesim.registry import SCORE_REGISTRY
from tracesim.replay import replay_layer

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "retention_score.py"


@pytest.fixture(scope="module")
def plugin():
    spec = importlib.util.spec_from_file_location("retention_score_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    SCORE_REGISTRY.register(module.RetentionScore)
    yield module
    SCORE_REGISTRY.unregister("retention")
    del sys.modules[spec.name]


def write_gates(path: Path, seq: str, shape, seed: int = 0) -> np.ndarray:
    beta = np.random.default_rng(seed).uniform(0.9, 1.0, size=shape)
    np.savez(path, **{seq: beta})
    return beta


@pytest.mark.parametrize("geometric", [True, False])
def test_retention_topk_keeps_the_loop_references_tokens(plugin, tmp_path, geometric):
    trace = synthetic_trace(2)
    PL = trace.prompt_length
    beta = write_gates(tmp_path / "gates.npz", trace.sequence_id,
                       (1, trace.n_kv_heads, trace.n_positions))
    policy = make_policy("retention", "topk", 0.3, score_params={
        "path": str(tmp_path / "gates.npz"), "geometric": geometric})
    res = replay_layer(trace, [policy], np.array([0]), n_layers=1)
    B = round(0.3 * PL)
    for g in range(trace.n_kv_heads):
        take = set(range(4))  # sinks = 4, window = 0
        util = {i: (beta[0, g, i] ** (PL + 1 - i) if geometric else beta[0, g, i])
                for i in range(PL) if i not in take}
        top = sorted(util, key=lambda i: (util[i], i), reverse=True)[:B - len(take)]
        kept = take | set(top)
        pi = res.tables.pi[0, g]
        assert set(np.flatnonzero(pi[:PL] == 1.0)) == kept


def test_retention_with_a_poisson_design_is_certified(plugin, tmp_path):
    trace = synthetic_trace(2)
    write_gates(tmp_path / "g.npz", trace.sequence_id, (1, trace.n_kv_heads, trace.n_positions))
    policy = make_policy("retention", "poisson", 0.3,
                         score_params={"path": str(tmp_path / "g.npz")})
    assert policy.certified
    res = replay_layer(trace, [policy], np.array([0, 1]), n_layers=1)
    pi = res.tables.pi[0]
    assert np.isclose(pi[:, :trace.prompt_length].sum(axis=1), round(0.3 * 80)).all()


@pytest.mark.parametrize("case,match", [
    ("missing", "no such file"),
    ("pickle", "not a readable .npz without pickles"),
    ("shape", "expected float \\(n_layers, n_kv_heads, n_positions\\)"),
    ("range", "values outside \\[0, 1\\]"),
])
def test_bad_score_files_name_the_file_and_field(plugin, tmp_path, case, match):
    path = tmp_path / f"{case}.npz"
    if case == "pickle":
        np.savez(path, s=np.array([{"a": 1}], dtype=object))
    elif case == "shape":
        np.savez(path, s=np.ones((2, 3)))
    elif case == "range":
        np.savez(path, s=np.full((1, 2, 4), 1.5))
    with pytest.raises(ValueError, match=match):
        make_policy("retention", "topk", 0.3, score_params={"path": str(path)})


def test_replay_cli_exits_2_on_a_score_file_without_the_sequence(plugin, tmp_path, capsys):
    store = build_store(tmp_path / "store", n_seqs=1, n_layers=1)
    np.savez(tmp_path / "other.npz", other=np.ones((1, 2, 200)))
    code = cli_main(["replay", str(store), "--score", "retention", "--design", "topk",
                     "--budget", "0.3", "--seeds", "1", "--no-progress",
                     "--score-params", json.dumps({"retention": {"path": str(
                         tmp_path / "other.npz")}}), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "other.npz" in err and "no field" in err and "Traceback" not in err
