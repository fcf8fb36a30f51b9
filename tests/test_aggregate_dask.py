"""``--scheduler``: the results' per-cluster sums through Dask DataFrame equal DuckDB's (counts
exactly, sums to 1e-12 relative) on Dask's synchronous and processes schedulers and on a local
distributed cluster, the report's claims are the same, and an unreachable scheduler exits 2."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import pytest
from tracesim.analysis.aggregate import open_results

from tests.sweep_fixtures import MINI_SPEC, build_sweep_store
from tracesim.app.cli import main as cli_main
from tracesim.sweep import run_sweep

pytest.importorskip("dask.dataframe")  # the cluster extra
pytest.importorskip("distributed")

ROOT = Path(__file__).resolve().parents[1]
SPEC = MINI_SPEC
#: (keys, values, where, squares) as the claims and figures ask them: plain keys, SQL CASE
#: keys, a filter, no keys at all, and a filter no row passes.
QUERIES = [
    (["allocator", "layer", "kv_head"], ["kept_tokens"], "\"score\" IS DISTINCT FROM 'full'",
     False),
    (["sequence_id", "score", "budget",
      "CASE WHEN \"design\" = 'topk' THEN 'topk' ELSE 'random' END AS arm"], ["rel_err"], None,
     True),
    (["sequence_id", "layer", "head"], ["wald_cov", "err2", "bound2"], "\"certified\"", True),
    ([], ["wald_cov", "err2"], None, True),
    (["sequence_id"], ["wald_cov"], "FALSE", True),
]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dask")
    build_sweep_store(root / "store", n_seqs=2, n_layers=2)
    (root / "spec.yaml").write_text(SPEC)
    run_sweep(root / "spec.yaml", workers=1, out=root / "a", progress=False)
    return root / "a"


def _same(duck: pd.DataFrame, dask: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(duck, dask, check_exact=False, rtol=1e-12, atol=0)


@pytest.mark.parametrize("query", QUERIES, ids=["plain", "case", "filtered", "total", "none"])
def test_dask_synchronous_sums_equal_duckdb(sweep, query):
    keys, values, where, squares = query
    duck = open_results(sweep).sums(keys, values, where, squares=squares)
    dask = open_results(sweep, scheduler="synchronous").sums(keys, values, where,
                                                             squares=squares)
    _same(duck, dask)
    if keys and where != "FALSE":
        assert len(duck) > 1 and (duck["rows"] > 0).all()


@pytest.fixture(autouse=True)
def _restore_environment(monkeypatch):
    """distributed's Nanny writes its pre-spawn variables (OMP_NUM_THREADS=1, ...) into this
    process's environment and leaves them there; later tests' subprocesses would inherit them
    (a capture child on one torch thread against an in-process run on two)."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_dask_processes_and_a_local_cluster_equal_duckdb(sweep):
    from distributed import LocalCluster

    keys, values, where, squares = QUERIES[1]
    duck = open_results(sweep).sums(keys, values, where, squares=squares)
    _same(duck, open_results(sweep, scheduler="processes").sums(keys, values, where,
                                                                squares=squares))
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster:
        on_cluster = open_results(sweep, scheduler=cluster.scheduler_address)
        _same(duck, on_cluster.sums(keys, values, where, squares=squares))


def _close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-12,
                                                                  abs_tol=1e-15)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_report_claims_are_the_same_with_dask(sweep):
    from tracesim.analysis.report import build_report

    prereg = ROOT / "data" / "prereg.yaml"
    duck = build_report(sweep, None, prereg_path=prereg, allow_prereg_change=True)
    dask = build_report(sweep, None, prereg_path=prereg, allow_prereg_change=True,
                        scheduler="synchronous")
    assert [c.verdict for c in dask.claims] == [c.verdict for c in duck.claims]
    for a, b in zip(duck.claims, dask.claims, strict=True):
        assert _close(asdict(a), asdict(b)), (asdict(a), asdict(b))
    assert any(c.verdict != "not evaluated" for c in duck.claims)
    assert duck.terminal_table() == dask.terminal_table()


def test_unreachable_scheduler_exits_2_naming_it(sweep, tmp_path, capsys):
    import socket

    with socket.socket() as s:  # a port nobody listens on: bound, then closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    rc = cli_main(["report", str(sweep), "--out", str(tmp_path / "r"), "--scheduler", address,
                   "--allow-prereg-change"])
    err = capsys.readouterr().err
    assert rc == 2
    assert address in err and "--scheduler" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()
