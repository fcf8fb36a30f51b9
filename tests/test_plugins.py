"""Plugins: a score installed as a small distribution reaches every worker of a sweep.

The distribution is installed without pip (:mod:`tests.plugin_dist`): a package and its
``*.dist-info`` written into a temporary directory on ``sys.path`` and ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from tests.plugin_dist import on_path, write_dist
from tests.sweep_fixtures import build_sweep_store
from tracesim.designs import Design, inclusion_probabilities
from tracesim.plugins import (
    plugin_provenance,
    provenance,
    register_design,
    register_proxy,
    register_score,
)
from tracesim.policies import SCORE_REGISTRY, Policy, Score, make_policy, make_score
from tracesim.proxies import Proxy
from tracesim.registry import DESIGN_REGISTRY, PROXY_REGISTRY
from tracesim.replay import replay
from tracesim.store import open_store
from tracesim.sweep import SpecError, load_spec, parse_spec, run_sweep

KEYS = ["store", "sequence_id", "layer", "config_id", "head", "query_index", "seed"]
DIST, VERSION, PKG, NAME = "tracesim-demo-plugin", "0.3.1", "tsdemo_plugin", "demo_vsq"

PLUGIN_SOURCE = '''\
"""A demo tracesim score: squared value norm plus one."""
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.policies import Score


@dataclass(frozen=True)
class ValueSquare(Score):
    name: ClassVar[str] = "demo_vsq"
    window: int = 0
    offset: float = 1.0

    def scores(self, trace, kv_head, end, seed=None):
        v = trace.values[kv_head, :end]
        return (v * v).sum(axis=1) + OFFSET_SCALE * self.offset
'''


def _write_dist(root: Path, offset_scale: str) -> None:
    write_dist(root, DIST, VERSION, PKG, PLUGIN_SOURCE.replace("OFFSET_SCALE", offset_scale),
               {"tracesim.scores": {NAME: f"{PKG}:ValueSquare"}})


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    _write_dist(root, "1.0")
    with on_path(root):
        yield root
    sys.modules.pop(PKG, None)
    SCORE_REGISTRY._loaded.pop(NAME, None)
    SCORE_REGISTRY.loaded_hash.pop(NAME, None)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugstore") / "store"
    return build_sweep_store(path, n_seqs=2, n_layers=2)


def _spec(store: Path, out: Path) -> dict:
    return {"name": "plugin", "store": str(store), "seeds": 2, "output": str(out),
            "grid": {"score": [NAME, "streaming_llm"], "design": ["topk", "poisson"],
                     "budget": [0.5], "score_params": {NAME: {"offset": [1.0, 2.0]}}}}


def _results(out: Path) -> pd.DataFrame:
    df = pq.read_table(out / "results" / "parts").to_pandas()
    return df.sort_values(KEYS).reset_index(drop=True)


def test_entry_point_is_found_and_described(installed):
    assert NAME in SCORE_REGISTRY and NAME in list(SCORE_REGISTRY)
    score = make_score(NAME, offset=2.0)
    assert type(score).__module__ == PKG and score.name == NAME
    prov = provenance("score", NAME)
    assert prov["distribution"] == DIST and prov["version"] == VERSION
    assert prov["source"] == "entry_point" and prov["source_hash"].startswith("sha256:")


def test_plugin_sweep_local_and_dask_identical_then_edit_reruns(installed, store, tmp_path):
    out = tmp_path / "out"
    local = run_sweep(_spec(store, out), backend="local", workers=1, threads_per_worker=1,
                      progress=False, warm_up=False)
    assert local.complete and local.tasks["done"] == local.tasks["total"] == 4
    ref = _results(out)
    assert set(ref["score"]) == {NAME, "StreamingLLMPress"}  # streaming_llm is the press
    # The workers computed what the plugin computes in this process.
    spec = parse_spec(_spec(store, out))
    direct = replay(open_store(store), list(spec.policies), seeds=2, progress=False).to_pandas()
    direct.insert(0, "model_id", "synthetic-sweep")
    direct.insert(0, "store", "store")
    pd.testing.assert_frame_equal(ref, direct.sort_values(KEYS).reset_index(drop=True),
                                  check_exact=True)

    dask_out = tmp_path / "dask"
    remote = run_sweep(_spec(store, dask_out), backend="dask", workers=1, threads_per_worker=1,
                       progress=False, warm_up=False)
    assert remote.complete and remote.spec_hash == local.spec_hash
    pd.testing.assert_frame_equal(_results(dask_out), ref, check_exact=True)

    # Editing the plugin changes the result hash: resuming reruns every task, never mixes.
    _write_dist(installed, "3.0")
    resumed = run_sweep(_spec(store, out), backend="local", workers=1, threads_per_worker=1,
                        progress=False, warm_up=False)
    assert resumed.spec_hash != local.spec_hash
    assert resumed.tasks["skipped"] == 0 and resumed.tasks["done"] == 4
    new = _results(out)
    assert len(new) == len(ref)
    mine = new["score"] == NAME
    assert not new[mine].reset_index(drop=True).equals(ref[mine].reset_index(drop=True))
    pd.testing.assert_frame_equal(new[~mine].reset_index(drop=True),
                                  ref[~mine].reset_index(drop=True), check_exact=True)
    _write_dist(installed, "1.0")


def test_unknown_plugin_name_is_a_spec_error(store, tmp_path):
    doc = _spec(store, tmp_path / "x")
    doc["grid"]["score"] = ["not_installed_score"]
    with pytest.raises(SpecError, match=r"grid.score\[0\]: unknown score 'not_installed_score'"):
        parse_spec(doc)


def test_decorator_in_process_and_refused_by_sweeps(store, tmp_path):
    @register_score
    @dataclass(frozen=True)
    class Recency2(Score):
        name: ClassVar[str] = "test_recency2"
        window: int = 0

        def scores(self, trace, kv_head, end, seed=None):
            return np.arange(1, end + 1, dtype=np.float64) ** 2

    try:
        with pytest.raises(ValueError, match="taken by a built-in"):
            register_score(type("X", (Recency2,), {"name": "snapkv"}))
        p = make_policy("test_recency2", "poisson", 0.5)
        table = replay(open_store(store), [p], seeds=2, progress=False)
        assert table.num_rows > 0
        assert plugin_provenance([p])[0]["source"] == "decorator"
        doc = _spec(store, tmp_path / "dec")
        doc["grid"] = {"score": "test_recency2", "design": "poisson", "budget": 0.5}
        with pytest.raises(ValueError, match="registered in this process only"):
            run_sweep(doc, workers=1, progress=False, warm_up=False)
    finally:
        SCORE_REGISTRY.registered.pop("test_recency2", None)
        SCORE_REGISTRY.loaded_hash.pop("test_recency2", None)


def test_compression_ratio_and_aliases_in_specs(store, tmp_path):
    doc = _spec(store, tmp_path / "cr")
    doc["grid"] = {"score": ["observed_attention", "streaming_llm", "keydiff"],
                   "design": "topk", "compression_ratio": [0.75, 0.5]}
    spec = parse_spec(doc)
    budgets = sorted({p.budget.value for p in spec.policies})
    assert budgets == [0.25, 0.5]
    assert {p.score.name for p in spec.policies} == {"ObservedAttentionPress",
                                                      "StreamingLLMPress", "keydiff"}
    h2o = next(p for p in spec.policies if p.score.name == "ObservedAttentionPress")
    assert h2o.score.normalize is True and h2o.score.window == 0 and h2o.score.sinks == 0
    doc["grid"]["budget"] = 0.5
    with pytest.raises(SpecError, match="either budget or compression_ratio"):
        parse_spec(doc)
    del doc["grid"]["budget"]
    doc["grid"]["compression_ratio"] = 1.0
    with pytest.raises(SpecError, match=r"compression_ratio: compression_ratio = 1.0"):
        parse_spec(doc)
    assert load_spec  # the YAML path goes through the same parser


def test_decorator_design_equals_the_builtin_it_mimics(store):
    from tracesim.designs import DESIGN_REGISTRY, Design
    from tracesim.plugins import register_design
    from tracesim.sweep import parse_grid

    @register_design
    @dataclass(frozen=True)
    class Flat(Design):
        name: ClassVar[str] = "test_flat"

        def inclusion_probabilities(self, scores, n):
            return np.full(len(scores), n / len(scores))

    try:
        grid = {"score": "snapkv", "design": ["test_flat", "bernoulli"], "budget": 0.4,
                "score_params": {"snapkv": {"window_source": "question", "window": 8}}}
        mine, ref = parse_grid(grid)
        a = replay(open_store(store), [mine], seeds=3, progress=False).to_pandas()
        b = replay(open_store(store), [ref], seeds=3, progress=False).to_pandas()
        cols = [c for c in a.columns if c not in ("config_id", "design")]
        pd.testing.assert_frame_equal(a[cols], b[cols], check_exact=True)
        assert plugin_provenance([mine])[0]["kind"] == "design"
    finally:
        DESIGN_REGISTRY.registered.pop("test_flat", None)
        DESIGN_REGISTRY.loaded_hash.pop("test_flat", None)


# ------------------------------------------------------- a design and a proxy from a test module
#
# Each is one class and one register call (docs/extending.md), defined here, outside tracesim.


@dataclass(frozen=True)
class PowerPPS(Design):
    """Capped PPS on ``scores ** power`` (power 1: exactly the built-in ``poisson``)."""

    name: ClassVar[str] = "test_power_pps"

    power: float = 1.0

    def inclusion_probabilities(self, scores, n):
        return inclusion_probabilities(np.asarray(scores, dtype=np.float64) ** self.power, n)


@dataclass(frozen=True)
class HeadDimsProxy(Proxy):
    """Logits from the first ``dims`` key channels (all of them: exactly the ``exact`` proxy)."""

    name: ClassVar[str] = "test_head_dims"

    dims: int = 8

    def bits_per_token(self, head_dim):
        return 16.0 * min(self.dims, head_dim)

    def logits(self, trace, kv_head, queries, end):
        k = self.dims
        return (queries[:, :k] @ trace.keys[kv_head, :end, :k].T) * trace.scale


@pytest.fixture
def power_design():
    register_design(PowerPPS)
    yield PowerPPS
    DESIGN_REGISTRY.registered.pop(PowerPPS.name, None)
    DESIGN_REGISTRY.loaded_hash.pop(PowerPPS.name, None)


@pytest.fixture
def head_dims_proxy():
    register_proxy(HeadDimsProxy)
    yield HeadDimsProxy
    PROXY_REGISTRY.registered.pop(HeadDimsProxy.name, None)
    PROXY_REGISTRY.loaded_hash.pop(HeadDimsProxy.name, None)


def _without(df: pd.DataFrame, *cols: str) -> pd.DataFrame:
    keys = ["sequence_id", "layer", "head", "query_index"]
    return df.drop(columns=list(cols)).sort_values(keys).reset_index(drop=True)


def test_plugin_design_replays_with_its_params_in_the_results(store, power_design):
    from tracesim.sweep import parse_grid

    grid = {"score": "snapkv", "design": ["test_power_pps", "poisson"], "budget": 0.4,
            "design_params": {"test_power_pps": {"power": [1.0, 0.5]}},
            "score_params": {"snapkv": {"window_source": "question", "window": 8}}}
    mine, half, ref = parse_grid(grid)
    assert mine.design == PowerPPS(power=1.0) and half.design == PowerPPS(power=0.5)
    assert Policy.from_dict(json.loads(mine.to_json())) == mine
    df = replay(open_store(store), [mine, half, ref], seeds=3, progress=False).to_pandas()
    params = df.groupby("design")["design_params"].agg(lambda s: sorted(set(s)))
    assert params["test_power_pps"] == ['{"power": 0.5}', '{"power": 1.0}']
    assert params["poisson"] == ['{"floor": 0.0, "mixture": 0.0}']
    assert df.loc[df["design"] == "test_power_pps", "mixture"].isna().all()
    # power 1 computes what poisson computes, bit for bit; power 0.5 something else
    cols = ("config_id", "design", "design_params", "mixture", "floor")
    a = _without(df[df["config_id"] == mine.id], *cols)
    pd.testing.assert_frame_equal(a, _without(df[df["config_id"] == ref.id], *cols),
                                  check_exact=True)
    b = _without(df[df["config_id"] == half.id], *cols)
    assert not np.array_equal(a["err2"].to_numpy(), b["err2"].to_numpy())
    assert plugin_provenance([half])[0]["kind"] == "design"


def test_plugin_proxy_replays_through_a_per_step_design(store, head_dims_proxy, tmp_path):
    from tracesim.proxies import make_proxy

    assert make_proxy("test_head_dims:4") == HeadDimsProxy(dims=4)
    assert make_proxy("test_head_dims").spec() == "test_head_dims:8"
    with pytest.raises(ValueError, match="dims = 'x': expected a positive integer"):
        make_proxy("test_head_dims:x")
    pols = [make_policy("perstep", "poisson", 0.4, schedule="step",
                        score_params={"proxy": proxy, "window": 8})
            for proxy in ("test_head_dims:8", "exact", "test_head_dims:2")]
    df = replay(open_store(store), pols, seeds=2, progress=False).to_pandas()
    params = df.groupby("config_id")["score_params"].first()
    assert json.loads(params[pols[0].id])["proxy"] == "test_head_dims:8"
    assert set(df["design_params"]) == {'{"floor": 0.0, "mixture": 0.0}'}
    # all eight channels: the exact proxy's logits, so its rows, bit for bit
    cols = ("config_id", "score_params", "deployable")
    mine = _without(df[df["config_id"] == pols[0].id], *cols)
    pd.testing.assert_frame_equal(mine, _without(df[df["config_id"] == pols[1].id], *cols),
                                  check_exact=True)
    two = _without(df[df["config_id"] == pols[2].id], *cols)
    assert not np.array_equal(mine["err2"].to_numpy(), two["err2"].to_numpy())
    # provenance names the proxy; a sweep refuses it (its workers never registered it)
    prov = plugin_provenance(pols)
    assert [(p["kind"], p["name"], p["source"]) for p in prov] == [
        ("proxy", "test_head_dims", "decorator")]
    doc = _spec(store, tmp_path / "proxy")
    doc["grid"] = {"score": "perstep", "design": "poisson", "budget": 0.5, "schedule": "step",
                   "score_params": {"perstep": {"proxy": "test_head_dims:4"}}}
    with pytest.raises(ValueError, match="registered in this process only"):
        run_sweep(doc, workers=1, progress=False, warm_up=False)


def test_the_registries_are_a_leaf_the_packages_fill():
    """``tracesim.registry`` imports none of the packages it serves (no import cycle), and
    importing it first still works: each package fills its registry when imported."""
    import ast
    import subprocess

    code = ("import sys, tracesim.registry as r\n"
            "print(sorted(m for m in sys.modules if m.startswith('tracesim.')))\n"
            "from tracesim.policies import SCORE_REGISTRY, make_policy\n"
            "from tracesim.proxies import make_proxy\n"
            "assert SCORE_REGISTRY is r.SCORE_REGISTRY and 'snapkv' in r.SCORE_REGISTRY\n"
            "assert 'poisson' in r.DESIGN_REGISTRY and make_proxy('quant:4').spec() == 'quant:4'\n"
            "make_policy('snapkv', 'poisson', 0.25)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    loaded = set(ast.literal_eval(out.stdout.split("\n")[0]))
    assert "tracesim.registry" in loaded
    assert not loaded & {"tracesim.designs", "tracesim.policies", "tracesim.proxies",
                         "tracesim.plugins", "tracesim.replay"}
