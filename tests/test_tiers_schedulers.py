"""The table of fetch schedulers: built-in rules twice over, and schedulers added from outside."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import numba
import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.replay_fixtures import build_store, synthetic_trace
from tests.test_tiers_kernel import _assert_same, _policy
from tracesim.kernels import tiers as kt
from tracesim.store import open_store
from tracesim.tiers import MemoryModel, Scheduler, parse_tiers_spec, run_tiers, simulate_layer
from tracesim.tiers import schedulers as sch
from tracesim.tiers.reference import simulate_layer_reference

#: A scheduler package as a user writes it: one file, one registration line (docs/extending.md).
PLUGIN = '''
"""Pages by their bound over their head's page count, half a uniform added."""
import numba
import numpy as np

from tracesim.tiers import Scheduler, register_scheduler


@numba.njit
def priority(x):
    return x.bound / max(1, x.head_pages) + 0.5 * x.uniform


def reference(x):
    return x.bound / np.maximum(1, x.head_pages) + 0.5 * x.uniform


# the oracle twice over: its order, hence its fetches, are the built-in oracle's
@numba.njit
def oracle_twice(x):
    return 2.0 * x.oracle_mass


def oracle_twice_reference(x):
    return 2.0 * x.oracle_mass


# the built-in certificate_bound rule, run through the registered-rule path
@numba.njit
def shares(x):
    return (x.page_cert / x.layer_cert if x.layer_cert > 0 else 0.0) + (
        x.bound / x.layer_bound if x.layer_bound > 0 else 0.0)


def shares_reference(x):
    return (x.page_cert / x.layer_cert if x.layer_cert > 0 else 0.0 * x.page_cert) + (
        x.bound / x.layer_bound if x.layer_bound > 0 else 0.0 * x.bound)


register_scheduler(Scheduler("bound_per_page", priority, reference, needs_bound=True,
                             needs_uniforms=True))
register_scheduler(Scheduler("oracle_twice", oracle_twice, oracle_twice_reference,
                             deployable=False))
register_scheduler(Scheduler("shares", shares, shares_reference, needs_certificate=True,
                             needs_bound=True))
'''
ADDED = ("bound_per_page", "oracle_twice", "shares")
#: Columns that must be equal between two schedulers that fetch the same pages.
SAME_FETCHES = ("err2_before", "err2_after", "cert2", "bytes_moved", "kv_bytes_moved",
                "pages_fetched", "evicted_bytes", "fetch_ms", "stall_ms", "bytes_dram",
                "bytes_nvme")


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """Import the plugin module from a directory outside the package; forget it afterwards."""
    monkeypatch.setattr(sch.SCHEDULER_REGISTRY, "registered", {})
    (tmp_path / "plugin_src").mkdir()
    (tmp_path / "plugin_src" / "my_fetch_rules.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path / "plugin_src"))
    monkeypatch.delitem(sys.modules, "my_fetch_rules", raising=False)
    return importlib.import_module("my_fetch_rules")


def _random_inputs(rng: np.random.Generator, n: int) -> sch.PageInputs:
    """Per-page inputs with zeros where the rules branch (empty heads, uncertified layers)."""
    def some_zero(x):
        return np.where(rng.random(n) < 0.3, 0.0, x)
    return sch.PageInputs(
        uniform=rng.random(n), bound=some_zero(rng.exponential(size=n)),
        oracle_mass=rng.random(n), page_cert=some_zero(rng.exponential(size=n)),
        head_cert=some_zero(rng.exponential(size=n)),
        head_bound=some_zero(rng.exponential(size=n)),
        head_pages=rng.integers(0, 5, size=n), layer_cert=float(rng.choice([0.0, 3.5])),
        layer_bound=float(rng.choice([0.0, 2.25])))


@numba.njit
def _compiled_over(rule, x, out):
    for i in range(out.size):
        out[i] = rule(sch.PageInputs(x.uniform[i], x.bound[i], x.oracle_mass[i],
                                     x.page_cert[i], x.head_cert[i], x.head_bound[i],
                                     x.head_pages[i], x.layer_cert, x.layer_bound))


@pytest.mark.parametrize("name", [s for s in sch.SCHEDULERS if s != "none"])
def test_each_builtin_rule_is_the_same_compiled_and_in_numpy(name):
    s = sch.BUILTIN_SCHEDULERS[name]
    rng = np.random.default_rng(sch.SCHEDULERS.index(name))
    for _ in range(4):
        x = _random_inputs(rng, 64)
        got = np.empty(64)
        _compiled_over(s.priority, x, got)
        np.testing.assert_array_equal(got, np.broadcast_to(s.reference(x), got.shape))


def test_the_table_lists_every_builtin_with_its_flags():
    assert sch.SCHEDULERS == ("none", "random", "confidence", "certificate",
                              "certificate_page", "bound", "oracle", "certificate_bound")
    assert sch.CERTIFIED_SCHEDULERS == {"certificate", "certificate_page", "certificate_bound"}
    assert sch.BOUND_SCHEDULERS == {"bound", "certificate", "certificate_page",
                                    "certificate_bound"}
    assert [s for s, ok in sch.DEPLOYABLE.items() if not ok] == ["oracle"]


def test_a_scheduler_needs_a_valid_name_and_rules(monkeypatch):
    monkeypatch.setattr(sch.SCHEDULER_REGISTRY, "registered", {})
    with pytest.raises(ValueError, match="name"):
        Scheduler("Not A Name", sch.PageInputs, sch.PageInputs)
    with pytest.raises(ValueError, match="reference"):
        Scheduler("mine", lambda x: x.bound, None)
    with pytest.raises(ValueError, match="needs_bound"):
        Scheduler("mine", lambda x: x.bound, lambda x: x.bound, needs_bound=1)
    with pytest.raises(ValueError, match="built-in"):
        sch.register_scheduler(Scheduler("bound", lambda x: x.bound, lambda x: x.bound))
    with pytest.raises(ValueError, match="unknown scheduler 'mine'"):
        sch.get_scheduler("mine")


def test_added_schedulers_match_the_numpy_reference_and_the_builtins(plugin, monkeypatch):
    trace = synthetic_trace(3, n_heads=4, n_kv=2, d=8, P=96, prompt_length=80)
    names = ("oracle", "certificate_bound", "random") + ADDED
    budgets = np.array([0.0, 0.02, 0.1, 0.5, 1.0])
    args = (trace, _policy(), np.arange(2), 2, MemoryModel(page=4), names, budgets)
    got = simulate_layer(*args)
    _assert_same(got, simulate_layer_reference(*args))
    # a rule through the registered path fetches exactly what the built-in fetches
    for added, builtin in (("oracle_twice", "oracle"), ("shares", "certificate_bound")):
        a, b = got["scheduler"] == added, got["scheduler"] == builtin
        for k in ("err2_after", "kv_bytes_moved", "pages_fetched", "stall_ms"):
            np.testing.assert_array_equal(got[k][a], got[k][b], err_msg=f"{added} {k}")
    # not vacuous: the new rule's order is neither the oracle's nor random's
    mid = got["fetch_budget"] == 0.1
    new = got["err2_after"][mid & (got["scheduler"] == "bound_per_page")]
    for other in ("oracle", "random"):
        assert not np.array_equal(new, got["err2_after"][mid & (got["scheduler"] == other)])
    # the parallel kernel calls the registered rules too, with the same results
    monkeypatch.setattr(kt, "SERIAL_BELOW", 0)
    parallel = simulate_layer(*args)
    for k, v in got.items():
        np.testing.assert_array_equal(np.asarray(parallel[k]), np.asarray(v), err_msg=k)


def test_an_added_scheduler_runs_through_run_tiers(plugin, tmp_path):
    store = open_store(build_store(tmp_path / "store", n_seqs=2, n_layers=2, o_proj=False))
    spec = parse_tiers_spec({"grid": {"score": ["snapkv"], "design": ["poisson"],
                                      "budget": [0.25], "score_params": {"*": {"window": 8}}},
                             "seeds": 2, "fetch_budgets": [0.0, 0.1, 1.0],
                             "memory": {"page": 4},
                             "schedulers": ["oracle", "certificate_bound", *ADDED]})
    summary = run_tiers(spec, store, tmp_path / "out")
    df = pq.read_table(tmp_path / "out" / "tiers.parquet").to_pandas()
    assert summary["rows"] == len(df) == 2 * 2 * 4 * 16 * 5 * 3
    assert sorted(df.scheduler.unique()) == sorted(["oracle", "certificate_bound", *ADDED])
    assert not df[df.scheduler == "oracle_twice"].deployable.any()
    assert df[df.scheduler == "bound_per_page"].deployable.all()
    keys = ["sequence_id", "layer", "head", "step", "fetch_budget"]
    for added, builtin in (("oracle_twice", "oracle"), ("shares", "certificate_bound")):
        a = df[df.scheduler == added].sort_values(keys).reset_index(drop=True)
        b = df[df.scheduler == builtin].sort_values(keys).reset_index(drop=True)
        for k in SAME_FETCHES:
            np.testing.assert_array_equal(a[k].to_numpy(), b[k].to_numpy(), err_msg=k)
    # the Dask backend's workers never ran the registration: refused with a clear message
    with pytest.raises(ValueError, match="registered in this process"):
        run_tiers(spec, store, tmp_path / "out2", backend="dask")


def test_the_documented_scheduler_runs_and_matches_its_numpy_rule(tmp_path, monkeypatch):
    """The example file of docs/extending.md, as printed there."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    section = doc.split("## A new fetch scheduler", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.setattr(sch.SCHEDULER_REGISTRY, "registered", {})
    (tmp_path / "my_fetch_rules.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_fetch_rules", raising=False)
    importlib.import_module("my_fetch_rules")
    trace = synthetic_trace(4, n_heads=4, n_kv=2, d=8, P=96, prompt_length=80)
    args = (trace, _policy(), np.arange(2), 2, MemoryModel(page=4), ("bound", "bound_mix"),
            np.array([0.0, 0.05, 0.2, 1.0]))
    got = simulate_layer(*args)
    _assert_same(got, simulate_layer_reference(*args))
    mid = got["fetch_budget"] == 0.05
    assert not np.array_equal(got["err2_after"][mid & (got["scheduler"] == "bound")],
                              got["err2_after"][mid & (got["scheduler"] == "bound_mix")])


def test_an_edited_rule_changes_the_spec_hash(plugin, tmp_path):
    doc = {"grid": {"score": ["snapkv"], "design": ["poisson"], "budget": [0.25]},
           "schedulers": ["oracle_twice"]}
    before = parse_tiers_spec(doc).spec_hash
    assert parse_tiers_spec(doc).spec_hash == before
    src = tmp_path / "plugin_src" / "my_fetch_rules.py"
    src.write_text(src.read_text().replace("2.0 * x.oracle_mass", "3.0 * x.oracle_mass"))
    assert parse_tiers_spec(doc).spec_hash != before
