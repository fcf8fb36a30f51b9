"""The report on small synthetic inputs: every claim gets a verdict row; the prereg guard holds."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tracesim.analysis.claims import INCONCLUSIVE, NOT_EVALUATED, NOT_SUPPORTED, SUPPORTED
from tracesim.analysis.prereg import PreregChangedError, prereg_hash
from tracesim.analysis.report import build_report, write_report

from tests.replay_fixtures import build_store
from tracesim.integrity import sign_results
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
    sign_results(results / "results.parquet")  # API-written results: record rows and sha256
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
                certificate_mean=cert, certificate_max=cert * 2 if certified else np.nan,
                # the answer span: no draws here, so the rows above stay those of the seed
                answer_tokens=5, answer_kept_share=1.0 if budget == 0.5 else 0.6,
                answer_kept_min=1.0 if budget == 0.5 else 0.2,
                answer_first_kept_share=1.0 if budget == 0.5 else 0.8,
                answer_last_kept_share=1.0 if budget == 0.5 else 0.4))
    outcomes = root / "outcomes"
    outcomes.mkdir()
    pq.write_table(pa.Table.from_pandas(pd.DataFrame(rows)), outcomes / "outcomes.parquet")
    (outcomes / "summary.json").write_text(json.dumps({"prereg": {"sha256":
                                                                  prereg_hash(PREREG)}}))
    sign_results(outcomes / "outcomes.parquet")  # as tracesim evict signs its own
    return root, store, results, outcomes


def test_report_has_a_verdict_for_every_claim_and_a_viewable_html(inputs, tmp_path):
    _, store, results, outcomes = inputs
    report = build_report(results, outcomes, prereg_path=PREREG, traces_dir=store)
    assert [c.claim for c in report.claims] == [f"C{i}" for i in range(13)]
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
    # the answer-span table follows the end-to-end accuracy table
    titles = list(report.tables)
    span = "answer span kept (next to end-to-end accuracy)"
    assert titles.index(span) == titles.index("end-to-end accuracy") + 1
    assert "accuracy_whole_kept" in report.tables[span] and span in page
    # Stands alone: provenance, the sample-size caveat, claim text and units, captions.
    assert "n = 3 sequences: a smoke test" in page  # replay results have 3 sequences
    for field_name in ("model", "tasks", "sequences", "prompt lengths", "seeds",
                       "tracesim version", "pre-registration"):
        assert f"<th>{field_name}</th>" in page
    assert prereg_hash(PREREG) in page
    assert "<th>hypothesis</th>" in page and "<th>estimate measures</th>" in page
    assert "share of certified" in page  # C1's units
    for name in ("certificate_vs_error", "coverage_vs_level", "coverage_by_head",
                 "accuracy_vs_budget", "error_vs_budget", "coverage"):
        assert name in report.figures and report.captions[name], name
        assert f"<figure id='{name}'>" in page
    assert page.count("<figcaption>") == len(report.figures)
    assert md.count("*Figure ") == len(report.figures)
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


def test_report_says_when_nothing_was_recorded(inputs, tmp_path):
    # a summary without a pre-registration entry is not a changed pre-registration: the
    # report is built, and says the claims were evaluated against the file as given
    import shutil

    _, _, results, outcomes = inputs
    copy = tmp_path / "results"
    shutil.copytree(results, copy)
    summary = json.loads((copy / "summary.json").read_text())
    del summary["prereg"]
    (copy / "summary.json").write_text(json.dumps(summary))
    report = build_report(copy, outcomes, prereg_path=PREREG)
    assert report.prereg_matches
    assert any("records no pre-registration" in n for n in report.notes)


def test_report_cli(inputs, tmp_path):
    from tracesim.app.cli import main

    _, _, results, outcomes = inputs
    assert main(["report", str(results), str(outcomes), "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "report.html").is_file()
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r2")]) == 2


def test_sample_size_tiers():
    from tracesim.analysis.provenance import sample_size_caveat

    assert sample_size_caveat(9)[1].startswith("n = 9 sequences: a smoke test")
    assert sample_size_caveat(1)[1].startswith("n = 1 sequence: a smoke test")
    assert [sample_size_caveat(n)[0] for n in (0, 9, 10, 29, 30, 99, 100, 5000)] == [
        "a smoke test", "a smoke test", "a pilot", "a pilot", "a small study", "a small study",
        "a study", "a study"]


def test_designs_that_ignore_the_score_are_labelled_once():
    from tracesim.analysis.report_figures import policy_labels

    df = pd.DataFrame({"score": ["snapkv", "h2o", "snapkv", "h2o", "vnorm", "h2o"],
                       "design": ["bernoulli", "bernoulli", "poisson", "poisson", "bernoulli",
                                  "poisson"],
                       "mixture": [np.nan, np.nan, 0.1, 0.1, np.nan, 1.0],
                       "top_fraction": [0, 0, 0, 0, 0.5, 0],
                       "allocator": ["uniform"] * 6})
    assert policy_labels(df).tolist() == [
        "bernoulli (any score)", "bernoulli (any score)", "snapkv / poisson", "h2o / poisson",
        "vnorm / bernoulli", "poisson (any score)"]


def test_coverage_heatmap_masks_thin_cells_and_fixes_the_scale(monkeypatch):
    """Cells with fewer sequences than the threshold are masked; the colour limits do not
    depend on the data (pure-noise coverage near nominal gives the same norm)."""
    from tracesim.analysis import report_figures as rf

    seen = []
    import matplotlib.colors

    monkeypatch.setattr(matplotlib.colors, "TwoSlopeNorm", lambda **kw: (
        seen.append(kw), matplotlib.colors.Normalize(kw["vmin"], kw["vmax"]))[1])
    rng = np.random.default_rng(1)
    rows = []
    for seq in range(4):
        for layer in range(3):
            for head in range(2):
                if layer == 2 and head == 1 and seq > 0:
                    continue  # one cell with a single sequence
                rows.append(dict(sequence_id=f"s{seq}", layer=layer, head=head,
                                 design="poisson", certified=True, cert2=1.0, err2=1.0,
                                 wald_cov=float(rng.random() < 0.95)))
    made = rf.coverage_heatmap(pd.DataFrame(rows), "wald_cov", 0.95)
    assert made is not None and made[0][:4] == b"\x89PNG"
    assert "1 of 6 cells masked" in made[1]
    assert seen == [{"vcenter": 0.95, "vmin": 0.0, "vmax": 1.0}]


def test_report_refuses_tampered_or_unsigned_outcomes(inputs, tmp_path):
    import shutil

    from tracesim.errors import UsageError

    root, store, results, outcomes = inputs
    base = pd.read_parquet(outcomes / "outcomes.parquet")
    forged = base.assign(correct=True)  # every answer right: C3 would change its verdict
    cases = {"forged column": forged, "duplicated rows": pd.concat([base, base]),
             "zero rows": base.iloc[:0]}
    for name, df in cases.items():
        d = tmp_path / name.replace(" ", "_")
        shutil.copytree(outcomes, d)
        pq.write_table(pa.Table.from_pandas(df, preserve_index=False), d / "outcomes.parquet")
        with pytest.raises(UsageError, match="outcomes.parquet") as err:
            build_report(results, d, prereg_path=PREREG)
        assert "expected" in str(err.value), name
    # A re-signed duplicate is still refused by its repeated keys; unsigned needs the flag.
    d = tmp_path / "resigned"
    shutil.copytree(outcomes, d)
    pq.write_table(pa.Table.from_pandas(pd.concat([base, base]), preserve_index=False),
                   d / "outcomes.parquet")
    sign_results(d / "outcomes.parquet")
    with pytest.raises(UsageError, match="repeat a result key"):
        build_report(results, d, prereg_path=PREREG)
    d = tmp_path / "unsigned"
    shutil.copytree(outcomes, d)
    (d / "summary.json").write_text(json.dumps({"prereg": {"sha256": prereg_hash(PREREG)}}))
    with pytest.raises(UsageError, match="results_sha256"):
        build_report(results, d, prereg_path=PREREG)
    report = build_report(results, d, prereg_path=PREREG, trust_unsigned=True)
    assert any("UNSIGNED" in n for n in report.notes)
