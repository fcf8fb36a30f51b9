"""One ``tracesim report`` call over several results inputs (``--results DIR``), and the
report's per-step section computed from sums: the streamed table equals the pandas table of
the rows, the first input's claims are unchanged by further inputs, and an input given twice,
missing or foreign is refused with exit 2 naming it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml
from tracesim.analysis.aggregate import open_results
from tracesim.analysis.perstep import by_table, perstep_table
from tracesim.analysis.perstep_costs import cost_columns
from tracesim.analysis.perstep_stream import (
    by_table_from,
    perstep_costs_table,
    pooled_and_by_tables,
)
from tracesim.analysis.results_io import load_results

from tests.sweep_fixtures import MINI_SPEC, build_sweep_store
from tracesim.app.cli import main as cli_main
from tracesim.sweep import run_sweep

#: MINI_SPEC's sweep with a per-step design beside the prefill one (both designs, one budget).
PERSTEP_GRID = [
    {"score": ["perstep"], "design": ["topk", "poisson"], "budget": [0.3],
     "schedule": ["step"], "score_params": {"perstep": {"proxy": ["exact", "quant:4"],
                                                        "window": 6}}},
    {"score": ["snapkv"], "design": ["topk", "poisson"], "budget": [0.3],
     "score_params": {"snapkv": {"window": 6}}},
]


def _spec(name: str, stores) -> str:
    doc = yaml.safe_load(MINI_SPEC)
    doc.update(name=name, store=stores, grid=PERSTEP_GRID)
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """``held`` (one store: the claims' input) and ``lengths`` (two stores of different
    lengths, as the length sweep): two small sweeps with per-step and prefill designs."""
    root = tmp_path_factory.mktemp("multi")
    build_sweep_store(root / "store", n_seqs=3, n_layers=1)
    build_sweep_store(root / "short", n_seqs=2, n_layers=1, P=56, prompt=44, seed=1)
    (root / "held.yaml").write_text(_spec("held", "store"))
    (root / "lengths.yaml").write_text(_spec("lengths", [{"path": "short", "name": "len56"},
                                                          {"path": "store", "name": "len72"}]))
    run_sweep(root / "held.yaml", workers=1, out=root / "held", progress=False)
    run_sweep(root / "lengths.yaml", workers=1, out=root / "lengths", progress=False)
    return root


def _same_table(new: pd.DataFrame, old: pd.DataFrame) -> None:
    """Same columns and rows; numbers to 1e-9 relative, NaN where NaN."""
    assert list(new.columns) == list(old.columns)
    assert len(new) == len(old) > 0
    for col in old.columns:
        for a, b in zip(new[col].tolist(), old[col].tolist(), strict=True):
            if isinstance(b, float) or isinstance(a, float):
                a, b = float(a), float(b)
                assert math.isnan(a) == math.isnan(b), (col, a, b)
                if not math.isnan(b):
                    assert abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1e-300), (col, a, b)
            else:
                assert a == b, (col, a, b)


def test_streamed_perstep_tables_equal_the_rows_tables(inputs):
    df, _ = load_results(inputs / "lengths")
    ds = open_results(inputs / "lengths")
    old = cost_columns(perstep_table(df, 8), df, 8)
    _same_table(perstep_costs_table(ds, 8), old)
    assert old["wald_ci"].notna().any() and old["wald"].isna().any()  # NaN compared too
    per_store = by_table(df, "store", 8)
    _same_table(by_table_from(ds, "store", 8), per_store)
    assert list(dict.fromkeys(per_store["store"])) == ["len56", "len72"]
    # the report's one pass: the pooled table and the per-store ones from the same group-bys
    pooled, by_store = pooled_and_by_tables(ds, "store", 8)
    _same_table(pooled, old)
    _same_table(by_store, per_store)
    assert (per_store["score"] == "perstep").any()


def _report(args: list[str], out: Path) -> int:
    return cli_main(["report", *map(str, args), "--out", str(out)])


def test_one_call_over_two_results_inputs(inputs, tmp_path, capsys):
    held, lengths = inputs / "held", inputs / "lengths"
    assert _report([held], tmp_path / "alone") == 0
    assert _report([held, "--results", lengths], tmp_path / "both") == 0
    capsys.readouterr()
    # the claims read the first input only: the same claims.json
    alone = json.loads((tmp_path / "alone" / "claims.json").read_text())
    both = json.loads((tmp_path / "both" / "claims.json").read_text())
    assert both == alone and alone
    md = (tmp_path / "both" / "report.md").read_text()
    assert "## per-step designs\n" in md
    section = md[md.index("## per-step designs: lengths (sweep lengths)"):]
    assert section.split("\n")[3].split()[0] == "store"  # one table per store
    assert "len56" in section and "len72" in section
    assert md.index("## per-step designs: lengths") < md.index("## Claims")
    assert "claims read RESULTS (held (sweep held)) only" in md
    for name, n_rows in (("held", len(open_results(held))),
                         ("lengths", len(open_results(lengths)))):
        sha = json.loads((inputs / name / "results" / "summary.json").read_text())
        assert f"{name} (sweep {name}): {n_rows:,} rows, {sha['results_sha256']} |" in md
    assert (tmp_path / "both" / "perstep_frontier.png").is_file()
    assert (tmp_path / "both" / "perstep_frontier_2_lengths.png").is_file()
    assert "lengths (sweep lengths): Per-step and prefill designs" in md
    # the first input alone: its section as before, the input in the provenance
    md_alone = (tmp_path / "alone" / "report.md").read_text()
    assert "per-step designs: " not in md_alone and "descriptive" not in md_alone
    assert "| results (the claims read it) | held (sweep held): " in md_alone


def _refused(args: list[str], out: Path, capsys, *words: str) -> None:
    assert _report(args, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err
    assert not (out / "claims.json").exists()


def test_the_same_results_twice_are_refused(inputs, tmp_path, capsys):
    held = inputs / "held"
    _refused([held, "--results", held], tmp_path / "a", capsys, "same directory", str(held))
    copy = tmp_path / "held-copy"
    shutil.copytree(held, copy)
    _refused([held, "--results", inputs / "lengths", "--results", copy], tmp_path / "b",
             capsys, "same results", str(copy), str(held))


def test_a_missing_or_foreign_results_input_is_refused(inputs, tmp_path, capsys):
    held = inputs / "held"
    missing = tmp_path / "nowhere"
    _refused([held, "--results", missing], tmp_path / "a", capsys, str(missing))
    _refused([held, "--results", inputs / "store"], tmp_path / "b", capsys,
             str(inputs / "store"))
    _refused(["--outcomes-only", held, "--results", inputs / "lengths"], tmp_path / "c",
             capsys, "give RESULTS")


def test_a_further_input_is_verified_as_the_first(inputs, tmp_path, capsys):
    unsigned = tmp_path / "unsigned"
    shutil.copytree(inputs / "lengths", unsigned)
    summary_path = unsigned / "results" / "summary.json"
    summary = json.loads(summary_path.read_text())
    del summary["results_sha256"]
    summary_path.write_text(json.dumps(summary))
    _refused([inputs / "held", "--results", unsigned], tmp_path / "a", capsys,
             str(summary_path), "results_sha256")
    assert _report([inputs / "held", "--results", unsigned, "--trust-unsigned"],
                   tmp_path / "b") == 0
    out = capsys.readouterr().out
    assert "WARNING: unsigned: UNSIGNED RESULTS" in out
    md = (tmp_path / "b" / "report.md").read_text()
    assert "per-step designs: unsigned (sweep lengths)" in md
