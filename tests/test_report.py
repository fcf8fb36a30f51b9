"""The report on small synthetic inputs: every claim gets a verdict row; the prereg guard holds."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analysis.claims import INCONCLUSIVE, NOT_EVALUATED, NOT_SUPPORTED, SUPPORTED
from analysis.prereg import PreregChangedError, prereg_hash
from analysis.report import build_report, write_report
from tests.replay_fixtures import build_store
from tracesim.policies import policy_grid
from tracesim.replay import replay

PREREG = Path(__file__).resolve().parents[1] / "data" / "prereg.yaml"
VERDICTS = {SUPPORTED, NOT_SUPPORTED, INCONCLUSIVE, NOT_EVALUATED}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    store = build_store(root / "traces", n_seqs=3, n_layers=2, P=120, prompt_length=96)
    policies = policy_grid(["snapkv", "h2o"], ["topk", "poisson"], [0.2, 0.35, 0.5],
                           score_params={"snapkv": {"window": 8}, "h2o": {"window": 8}})
    table = replay(store, policies, seeds=8, progress=False)
    results = root / "results"
    results.mkdir()
    pq.write_table(table, results / "results.parquet")
    (results / "summary.json").write_text(json.dumps({"prereg": {"sha256": prereg_hash(PREREG)}}))
    (results / "adversary.json").write_text(json.dumps({"rows": [
        {"t": 0.0, "topk_identical": True, "topk_err2": 0.1, "poisson_cert2": 0.2},
        {"t": 100.0, "topk_identical": True, "topk_err2": 50.0, "poisson_cert2": 30.0}]}))
    rng = np.random.default_rng(0)
    rows = []
    for s in range(12):
        full_correct = bool(s % 3)
        for design, budget in (("topk", 0.25), ("poisson", 0.25), ("topk", 0.5),
                               ("poisson", 0.5)):
            certified = design == "poisson"
            cert = rng.gamma(2.0) if certified else np.nan
            correct = bool(full_correct and rng.random() < 0.7)
            rows.append(dict(
                sequence_id=f"s{s}", config_id=f"snapkv|{design}|{budget}", score="snapkv",
                design=design, correction="hajek" if certified else "none", budget=budget,
                score_params=json.dumps({"question_aware": True}), certified=certified,
                correct=correct, full_correct=full_correct,
                failure=("none" if correct else "cache_induced" if full_correct else "inherent"),
                logprob_mean=-rng.gamma(1.0) - (0 if correct else 0.5),
                certificate_mean=cert, certificate_max=cert * 2 if certified else np.nan))
    outcomes = root / "outcomes"
    outcomes.mkdir()
    pq.write_table(pa.Table.from_pandas(pd.DataFrame(rows)), outcomes / "outcomes.parquet")
    (outcomes / "summary.json").write_text(json.dumps({"prereg": {"sha256":
                                                                  prereg_hash(PREREG)}}))
    return root, store, results, outcomes


def test_report_has_a_verdict_for_every_claim_and_a_viewable_html(inputs, tmp_path):
    _, store, results, outcomes = inputs
    report = build_report(results, outcomes, prereg_path=PREREG, traces_dir=store)
    assert [c.claim for c in report.claims] == [f"C{i}" for i in range(9)]
    assert all(c.verdict in VERDICTS for c in report.claims)
    by_id = {c.claim: c for c in report.claims}
    assert by_id["C0"].verdict == SUPPORTED
    assert by_id["C1"].verdict != NOT_EVALUATED and 0 <= by_id["C1"].estimate <= 1
    for cid in ("C1", "C2", "C5", "C7", "C3", "C4", "C6"):
        assert by_id[cid].verdict != NOT_EVALUATED, (cid, by_id[cid].detail)
    # Holm-adjusted p-values are at least the raw ones.
    for c in report.claims:
        if np.isfinite(c.pvalue):
            assert c.adjusted_pvalue >= c.pvalue - 1e-12
    path = write_report(report, tmp_path / "report")
    page = path.read_text()
    assert page.count("data:image/png;base64,") >= 4
    for cid in by_id:
        assert f"<td>{cid}</td>" in page
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| C7 |" in md
    table = report.terminal_table()
    assert table.splitlines()[0].startswith("claim")


def test_report_refuses_a_changed_preregistration(inputs, tmp_path):
    _, _, results, outcomes = inputs
    changed = tmp_path / "prereg.yaml"
    changed.write_text(PREREG.read_text().replace("margin: 0.05", "margin: 0.10", 1))
    with pytest.raises(PreregChangedError, match="changed after the results"):
        build_report(results, outcomes, prereg_path=changed)
    report = build_report(results, outcomes, prereg_path=changed, allow_prereg_change=True)
    assert not report.prereg_matches and "WARNING" in report.notes[0]


def test_report_cli(inputs, tmp_path):
    from tracesim.cli import main

    _, _, results, outcomes = inputs
    assert main(["report", str(results), str(outcomes), "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "report.html").is_file()
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r2")]) == 2
