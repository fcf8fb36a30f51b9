"""Plugins: a score installed as a small distribution reaches every worker of a sweep.

The distribution is installed without pip: a package and its ``*.dist-info`` (METADATA,
entry_points.txt, RECORD) are written into a temporary directory that is put on ``sys.path``
and ``PYTHONPATH``, which is all an installer does for a pure-Python wheel.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from tests.sweep_fixtures import build_sweep_store
from tracesim.plugins import plugin_provenance, provenance, register_score
from tracesim.policies import SCORE_REGISTRY, Score, make_policy, make_score
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
    pkg = root / PKG
    pkg.mkdir(parents=True, exist_ok=True)
    src = PLUGIN_SOURCE.replace("OFFSET_SCALE", offset_scale)
    (pkg / "__init__.py").write_text(src)
    info = root / f"{PKG}-{VERSION}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: {VERSION}\n")
    (info / "entry_points.txt").write_text(f"[tracesim.scores]\n{NAME} = {PKG}:ValueSquare\n")
    digest = hashlib.sha256(src.encode()).hexdigest()
    (info / "RECORD").write_text(f"{PKG}/__init__.py,sha256={digest},{len(src)}\n"
                                 f"{info.name}/METADATA,,\n{info.name}/entry_points.txt,,\n"
                                 f"{info.name}/RECORD,,\n")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    _write_dist(root, "1.0")
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(root))
    old = __import__("os").environ.get("PYTHONPATH", "")
    mp.setenv("PYTHONPATH", f"{root}:{old}" if old else str(root))
    importlib.invalidate_caches()
    yield root
    mp.undo()
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
    df = pq.read_table(out / "results" / "results.parquet").to_pandas()
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
                "score_params": {"snapkv": {"window_source": "question"}}}
        mine, ref = parse_grid(grid)
        a = replay(open_store(store), [mine], seeds=3, progress=False).to_pandas()
        b = replay(open_store(store), [ref], seeds=3, progress=False).to_pandas()
        cols = [c for c in a.columns if c not in ("config_id", "design")]
        pd.testing.assert_frame_equal(a[cols], b[cols], check_exact=True)
        assert plugin_provenance([mine])[0]["kind"] == "design"
    finally:
        DESIGN_REGISTRY.registered.pop("test_flat", None)
        DESIGN_REGISTRY.loaded_hash.pop("test_flat", None)
