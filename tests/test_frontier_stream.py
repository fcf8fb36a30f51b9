"""``tracesim frontier`` streams (one family's rows at a time, the per-step section from sums)
and writes what the whole-table computation wrote: the same frontier table (estimates to 1e-9
relative), the same validity rules and notes, the same per-step costs, on a sweep's dataset and
on a single replay file with per-step designs, with fitted and with given rules."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from tracesim.analysis.aggregate import ResultsDataset
from tracesim.analysis.claims_c8 import c8_rows
from tracesim.analysis.frontier import frontier_table
from tracesim.analysis.frontier_cli import load_frontier_results, run_frontier
from tracesim.analysis.perstep import perstep_table
from tracesim.analysis.perstep_costs import cost_columns
from tracesim.analysis.perstep_stream import perstep_costs_table
from tracesim.analysis.prereg import load_prereg
from tracesim.analysis.validity import (
    SplitSettings,
    check_rules,
    fit_rules,
    load_rules,
    split_sequences,
)

from tests.sweep_fixtures import build_sweep_store
from tracesim.sweep import run_sweep

ROOT = Path(__file__).resolve().parents[1]
PREREG = ROOT / "data" / "prereg.yaml"
SPEC = """\
name: fam
store: store
layers: all
grid:
  score: [snapkv, random, oracle]
  design: [topk, poisson]
  budget: [0.25, 0.5]
  score_params:
    "*": {window: 6}
seeds: 2
output: out
"""


def _old_frontier(results: Path, rules_path: Path | None = None):
    """The whole-table computation ``run_frontier`` did before it streamed."""
    df = load_frontier_results(results)
    prereg = load_prereg(PREREG)
    settings = SplitSettings.from_claim(prereg.claims["C8"])
    split = split_sequences(df["sequence_id"].unique(), settings.salt, settings.fraction)
    held = [s for s, c in split.items() if not c]
    notes = [f"validity rules: split salt `{settings.salt}`, calibration fraction "
             f"{settings.fraction}: {len(split) - len(held)} calibration, {len(held)} held-out "
             f"sequences"]
    if rules_path is not None:
        rules = load_rules(rules_path)
    else:
        cert = c8_rows(df, {**prereg.claims["C8"], "compare": {}, "deployable_only": False})
        rules, fit_notes = fit_rules(cert, settings)
        notes += fit_notes
    check_rules(rules, settings, held)
    if "n_seeds" in df and (df["n_seeds"] > 1).any():
        notes.append("aggregated rows: m and n_eff are seed means; fit rules on per-seed rows")
    table, more = frontier_table(df, rules=rules or None, salt=settings.salt,
                                 fraction=settings.fraction)
    return table, notes + more, rules, df


def _same_table(new: pd.DataFrame, old: pd.DataFrame) -> None:
    assert list(new.columns) == list(old.columns) and len(new) == len(old)
    for c in old.columns:
        a, b = new[c], old[c]
        if pd.api.types.is_float_dtype(b):
            assert np.allclose(a.to_numpy(float), b.to_numpy(float), rtol=1e-9, atol=1e-15,
                               equal_nan=True), c
        else:
            assert a.astype(str).tolist() == b.astype(str).tolist(), c


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fstream")
    build_sweep_store(root / "store", n_seqs=6, n_layers=2)
    (root / "spec.yaml").write_text(SPEC)
    run_sweep(root / "spec.yaml", workers=1, out=root / "a", progress=False)
    return root / "a"


@pytest.mark.parametrize("chunk_rows", [None, 1, 2500],
                         ids=["one-read", "per-family", "two-per-read"])
def test_streamed_frontier_equals_the_whole_table_computation(sweep, tmp_path, monkeypatch,
                                                              chunk_rows):
    from tracesim.analysis import frontier_stream

    if chunk_rows is not None:  # families read one at a time, or a few per read
        monkeypatch.setattr(frontier_stream, "CHUNK_ROWS", chunk_rows)
    table, notes = run_frontier(sweep, tmp_path / "f")
    old, old_notes, old_rules, _ = _old_frontier(sweep)
    _same_table(table, old)
    assert notes == old_notes
    assert old_rules, "the fixture must fit rules, or the ruled variant is not compared"
    assert {"wald", "ruled", "none"} <= set(table["variant"])
    assert table["family"].nunique() >= 6
    written = json.loads((tmp_path / "f" / "validity_rules.json").read_text())
    assert [r["config_id"] for r in written["rules"]] == list(old_rules)
    assert load_rules(tmp_path / "f" / "validity_rules.json") == old_rules
    # the saved frontier is the table returned
    _same_table(pq.read_table(tmp_path / "f" / "frontier.parquet").to_pandas(), old)


class _Recorded:
    """A DuckDB connection that records the statements run on it."""

    def __init__(self, con, log: list[str]):
        self._con, self._log = con, log

    def sql(self, query: str, *args, **kwargs):
        self._log.append(query)
        return self._con.sql(query, *args, **kwargs)

    def execute(self, query: str, *args, **kwargs):
        self._log.append(query)
        return self._con.execute(query, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._con, name)


def test_the_results_are_scanned_a_fixed_number_of_times(sweep, monkeypatch):
    """One read per family (CHUNK_ROWS = 1) still scans the results three times: the
    sequences, one row per configuration, one sorted copy of the rows; every read hits the
    copy by its ``__chunk``. A read of the results per family (issue 28: ~40 full scans at
    10^7 rows) fails this."""
    from tracesim.analysis import frontier_stream
    from tracesim.analysis.aggregate import ResultsDataset

    statements: dict[str, list[str]] = {}
    connect = ResultsDataset._connect

    def recorded(self):
        con = connect(self)
        if isinstance(con, _Recorded):
            return con
        self._con = _Recorded(con, statements.setdefault(str(self.files[0]), []))
        return self._con

    monkeypatch.setattr(ResultsDataset, "_connect", recorded)
    monkeypatch.setattr(frontier_stream, "CHUNK_ROWS", 1)
    settings = SplitSettings.from_claim(load_prereg(PREREG).claims["C8"])
    ds = frontier_stream.open_frontier_results(sweep)
    try:
        table, _, rules = frontier_stream.stream_frontier(ds, settings, None, 0.05)
    finally:
        ds.close()
    assert rules and table["family"].nunique() >= 6
    results = [s for f, log in statements.items() if "rows.parquet" not in f for s in log
               if not s.startswith("SET ")]
    copy = [s for f, log in statements.items() if "rows.parquet" in f for s in log]
    assert len(results) == 3, results
    assert sum("COPY" in s and "ORDER BY" in s for s in results) == 1
    reads = [s for s in copy if not s.startswith("SELECT count(*)")]
    assert len(reads) >= table["family"].nunique() and all('"__chunk" = ' in s for s in reads)


def test_given_rules_give_the_same_frontier(sweep, tmp_path):
    run_frontier(sweep, tmp_path / "f")
    rules = tmp_path / "f" / "validity_rules.json"
    table, notes = run_frontier(sweep, tmp_path / "g", rules_path=rules)
    old, old_notes, _, _ = _old_frontier(sweep, rules)
    _same_table(table, old)
    assert notes == old_notes


@pytest.fixture(scope="module")
def perstep_results(tmp_path_factory) -> Path:
    from tests.replay_fixtures import build_store
    from tracesim.integrity import sign_results
    from tracesim.policies import make_policy
    from tracesim.replay import replay
    from tracesim.store import open_store

    root = tmp_path_factory.mktemp("pstream")
    store = open_store(build_store(root / "store", n_seqs=4, n_layers=1))
    pols = [make_policy("perstep", "poisson", 0.4, schedule="step",
                        score_params={"proxy": "quant:4", "window": 8}),
            make_policy("perstep", "topk", 0.4, schedule="step",
                        score_params={"proxy": "quant:4", "window": 8}),
            make_policy("snapkv", "poisson", 0.4, score_params={"window": 8}),
            make_policy("snapkv", "topk", 0.4, score_params={"window": 8})]
    table = replay(store, pols, seeds=2, progress=False)
    pq.write_table(table, root / "results.parquet")
    sign_results(root / "results.parquet")
    return root / "results.parquet"


def test_perstep_costs_from_sums_equal_the_rows_computation(perstep_results):
    df = pq.read_table(perstep_results).to_pandas()
    old = cost_columns(perstep_table(df, 8), df, 8)
    new = perstep_costs_table(ResultsDataset.from_frame(df), 8)
    _same_table(new, old)
    assert (old["score"] == "perstep").any()
    assert old.loc[old["design"] == "poisson", "wald_ci"].notna().all()  # intervals compared
    assert old["mse_vs_topk"].notna().all()


def test_single_file_with_per_step_designs(perstep_results, tmp_path):
    table, notes = run_frontier(perstep_results, tmp_path / "f")
    old, old_notes, _, df = _old_frontier(perstep_results)
    _same_table(table, old)
    assert notes == old_notes
    md = (tmp_path / "f" / "frontier.md").read_text()
    section = md[md.index("## Per-step designs"):]
    assert "| perstep | quant:4 | poisson | step(fresh) |" in section
    old_costs = cost_columns(perstep_table(df, 64), df, 64)
    for r in old_costs.itertuples():
        assert f"{r.hbm_kib:.5g}" in section


def _old_perstep_stdout(results_dir: Path, *, by: str | None = None,
                        calibration: Path | None = None) -> str:
    """What ``python -m tracesim.analysis.perstep`` printed when it loaded the whole table."""
    from tracesim.analysis.perstep import _ratio, by_table, conformal_radius
    from tracesim.analysis.results_io import load_results

    df, _ = load_results(results_dir)
    table = (by_table(df, by, 64) if by else cost_columns(perstep_table(df, 64), df, 64))
    if calibration is not None:
        cal, _ = load_results(calibration)
        radius = conformal_radius(cal)
        order = df.drop_duplicates("config_id")["config_id"]
        table["kappa"] = [radius.get(c, np.nan) for c in order]
        cover = {c: float(np.mean(_ratio(g) <= radius[c])) for c, g in
                 df[df["certified"]].groupby("config_id") if c in radius}
        table["conf_cov"] = [cover.get(c, np.nan) for c in order]
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        return table.to_string(index=False, float_format=lambda x: f"{x:.4g}") + "\n"


@pytest.mark.parametrize("options", [{}, {"by": "head"}, {"calibration": True}],
                         ids=["plain", "by", "calibration"])
def test_perstep_command_prints_what_the_whole_table_gave(perstep_results, options, capsys):
    from tracesim.analysis.perstep import main

    d = perstep_results.parent
    argv = [str(d)]
    if "by" in options:
        argv += ["--by", options["by"]]
    if options.get("calibration"):
        argv += ["--calibration", str(d)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    old = _old_perstep_stdout(d, by=options.get("by"),
                              calibration=d if options.get("calibration") else None)
    assert out == old
    if options.get("calibration"):
        assert "kappa" in out and "conf_cov" in out


def test_perstep_command_with_dask_prints_the_same(perstep_results, capsys):
    pytest.importorskip("dask.dataframe")  # the cluster extra
    from tracesim.analysis.perstep import main

    d = str(perstep_results.parent)
    assert main([d]) == 0
    duck = capsys.readouterr().out
    assert main([d, "--scheduler", "synchronous"]) == 0
    assert capsys.readouterr().out == duck


def test_ambiguous_topk_baseline_is_refused_naming_it(perstep_results):
    df = pq.read_table(perstep_results).to_pandas()
    topk = df[(df["design"] == "topk") & (df["score"] == "snapkv")].copy()
    # the same top-k under another allocator: two baselines for one (score, budget)
    topk["config_id"] = topk["config_id"].str.replace("|uniform:", "|adakv:", regex=False)
    with pytest.raises(ValueError, match="2 top-k configurations share score 'snapkv'.*--by"):
        perstep_table(pd.concat([df, topk], ignore_index=True), 8)
