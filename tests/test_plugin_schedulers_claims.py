"""A fetch scheduler and a claim installed as a small distribution (entry points
``tracesim.schedulers`` and ``tracesim.claims``, :mod:`tests.plugin_dist`) are found by
``tracesim tiers`` (local and on two Dask workers), ``tracesim report`` and the in-loop fetch;
editing the plugin changes the tiers spec hash, so a resumed run recomputes every part."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.plugin_dist import on_path, write_dist
from tests.replay_fixtures import build_store
from tracesim.app.cli import main
from tracesim.integrity import sign_results
from tracesim.registry import CLAIM_REGISTRY, SCHEDULER_REGISTRY

DIST, VERSION, PKG = "tracesim-demo-fetch", "0.1.0", "tsdemo_fetch"
PREREG = Path(__file__).resolve().parents[1] / "data" / "prereg.yaml"

# The scheduler is ``bound`` under another name (x * 1.0 == x exactly), so its rows must equal
# bound's; the claim counts the results rows it is given.
PLUGIN_SOURCE = '''\
"""A demo tracesim plugin: a fetch scheduler and a claim."""
from tracesim.analysis.claims import Claim, ClaimResult
from tracesim.tiers import Scheduler

SCALE = SCALE_VALUE


def priority(x):
    return x.bound * SCALE


def reference(x):
    return x.bound * SCALE


DEMO_FETCH = Scheduler("demo_fetch", priority, reference, needs_bound=True)


def evaluate(inputs):
    res = ClaimResult("C99", inputs.prereg.claims["C99"]["hypothesis"])
    res.estimate = float(len(inputs.results)) * SCALE
    res.detail = "rows counted"
    return res


C99 = Claim("C99", evaluate, "rows of the results", needs=("results",))
'''

C99_ENTRY = """
  C99:
    hypothesis: The results have rows.
    metric: rows
    compare: {score: snapkv}
    test: none (a count)
    alpha: 0.05
    verdict: inconclusive always
"""


def _write(root: Path, scale: str) -> None:
    write_dist(root, DIST, VERSION, PKG, PLUGIN_SOURCE.replace("SCALE_VALUE", scale),
               {"tracesim.schedulers": {"demo_fetch": f"{PKG}:DEMO_FETCH"},
                "tracesim.claims": {"C99": f"{PKG}:C99"}})


def _forget() -> None:
    """Drop what this process loaded from the plugin (other tests never see it)."""
    sys.modules.pop(PKG, None)
    for reg, name in ((SCHEDULER_REGISTRY, "demo_fetch"), (CLAIM_REGISTRY, "C99")):
        reg._loaded.pop(name, None)
        reg.loaded_hash.pop(name, None)


@pytest.fixture
def installed(tmp_path):
    root = tmp_path / "site"
    _write(root, "1.0")
    with on_path(root):
        yield root
        _forget()
    _forget()


def test_plugin_scheduler_from_the_cli_local_and_on_two_dask_workers(installed, tmp_path,
                                                                     capsys):
    build_store(tmp_path / "store", n_seqs=2, n_layers=1, o_proj=False)
    spec = tmp_path / "tiers.yaml"
    spec.write_text("store: store\n"
                    "grid: {score: [snapkv], design: [poisson], budget: [0.25], "
                    "score_params: {'*': {window: 8}}}\n"
                    "seeds: 1\nschedulers: [bound, demo_fetch]\nfetch_budgets: [0.1, 0.5]\n"
                    "memory: {page: 4}\n")
    local, dask = tmp_path / "local", tmp_path / "dask"
    assert main(["tiers", "--spec", str(spec), "--out", str(local), "--quiet"]) == 0
    assert main(["tiers", "--spec", str(spec), "--out", str(dask), "--quiet",
                 "--backend", "dask", "--workers", "2"]) == 0
    t = pq.read_table(local / "tiers.parquet")
    assert pq.read_table(dask / "tiers.parquet").equals(t)   # the workers found the plugin
    df = t.to_pandas()
    mine, bound = df[df["scheduler"] == "demo_fetch"], df[df["scheduler"] == "bound"]
    assert len(mine) == len(bound) > 0 and mine["pages_fetched"].sum() > 0
    np.testing.assert_array_equal(mine.drop(columns="scheduler").to_numpy(),
                                  bound.drop(columns="scheduler").to_numpy())
    before = json.loads((local / "summary.json").read_text())
    # Editing the plugin: a new spec hash, every part recomputed (never mixed), same numbers.
    _write(installed, "(2.0 - 1.0)")
    capsys.readouterr()
    assert main(["tiers", "--spec", str(spec), "--out", str(local), "--quiet"]) == 0
    after = json.loads((local / "summary.json").read_text())
    assert after["spec_hash"] != before["spec_hash"] and after["parts_resumed"] == 0
    assert pq.read_table(local / "tiers.parquet").equals(t)


def _results(root: Path, prereg: Path) -> Path:
    from tracesim.analysis.prereg import prereg_hash

    from tracesim.policies import make_policy
    from tracesim.replay import replay

    store = build_store(root / "traces", n_seqs=2, n_layers=1, P=96, prompt_length=80)
    table = replay(store, [make_policy("snapkv", "poisson", 0.3, score_params={"window": 8})],
                   seeds=1, progress=False)
    results = root / "results"
    results.mkdir()
    pq.write_table(table, results / "results.parquet")
    (results / "summary.json").write_text(json.dumps({"prereg": {"sha256": prereg_hash(prereg)}}))
    sign_results(results / "results.parquet")
    return results


def test_plugin_claim_from_the_cli_and_seen_by_two_dask_workers(installed, tmp_path):
    from distributed import Client, LocalCluster
    from tracesim.analysis.claim_registry import claim_ids

    from tracesim.plugins import provenance

    prereg = tmp_path / "prereg.yaml"
    prereg.write_text(PREREG.read_text() + C99_ENTRY)
    results = _results(tmp_path, prereg)
    # installed but not pre-registered: refused, one line naming the claim
    assert main(["report", str(results), "--out", str(tmp_path / "r0")]) == 2
    assert main(["report", str(results), "--prereg", str(prereg), "--out",
                 str(tmp_path / "r")]) == 0
    saved = {c["claim"]: c for c in json.loads((tmp_path / "r" / "claims.json").read_text())}
    assert saved["C99"]["estimate"] == pq.read_metadata(results / "results.parquet").num_rows
    plugin = saved["C99"]["extra"]["plugin"]
    assert plugin["distribution"] == DIST and plugin["version"] == VERSION
    assert plugin["source"] == "entry_point"
    assert plugin["source_hash"] == provenance("claim", "C99")["source_hash"]
    assert "extra" not in saved["C2"] or "plugin" not in saved["C2"]["extra"]

    def seen() -> tuple[list[str], str, bool]:
        from tracesim.analysis.claim_registry import claim_ids

        from tracesim.plugins import provenance
        from tracesim.tiers.schedulers import get_scheduler

        return (claim_ids(), provenance("claim", "C99")["source_hash"],
                get_scheduler("demo_fetch").in_loop)

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        answers = client.run(seen)
    assert len(answers) == 2
    for ids, digest, in_loop in answers.values():
        assert ids == claim_ids() and ids[-1] == "C99"
        assert digest == plugin["source_hash"] and in_loop


@pytest.mark.capture
def test_plugin_scheduler_in_the_loop_fetches_what_bound_fetches(installed, tiny_store):
    from tracesim.capture.inloop.evict import decode_policy, layer_plans
    from tracesim.capture.inloop.fetch import FetchConfig

    from tests.evict_fixtures import prefilled
    from tracesim.policies import make_policy
    from tracesim.tiers import MemoryModel

    store, loaded, seq, meta, P, pre = prefilled(tiny_store)
    n = len(meta["generated_ids"])
    policy = make_policy("snapkv", "poisson", 0.3, score_params={"window": 8})
    plans = layer_plans(pre.traces, policy, 5)
    runs = [decode_policy(loaded.model, pre, plans, n, set(), policy, 5,
                          fetch=FetchConfig(s, 0.3, MemoryModel(page=4)))
            for s in ("bound", "demo_fetch")]
    assert runs[1].generated_ids == runs[0].generated_ids
    assert runs[1].logprobs == runs[0].logprobs
    assert len(runs[1].fetch_log) == len(runs[0].fetch_log) > 0
    moved = 0.0
    for (s0, l0, f0), (s1, l1, f1) in zip(runs[0].fetch_log, runs[1].fetch_log, strict=True):
        assert (s0, l0, f0.bytes_moved) == (s1, l1, f1.bytes_moved)
        for a, b in zip(f0.pages, f1.pages, strict=True):
            np.testing.assert_array_equal(a, b)
        moved += f1.bytes_moved
    assert moved > 0
