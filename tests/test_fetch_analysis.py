"""In-loop fetch outcomes: the accuracy/bytes table, paired tests and the report section."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tracesim.analysis.fetch import compare_fetch, fetch_figure, fetch_table, split_fetch_outcomes
from tracesim.analysis.prereg import prereg_hash
from tracesim.analysis.report import build_report

from tests.test_report import PREREG, inputs  # noqa: F401  (the fixture)

# Correct answers per (scheduler, sequence) over two seeds: certificate_bound is right on
# sequences 0-5 in both seeds, random only on sequence 0 in seed 0.
N_SEQ = 8


def _correct(sched: str, s: int, seed: int) -> bool:
    if sched == "certificate_bound":
        return s < 6
    if sched == "random":
        return s == 0 and seed == 0
    return False


def _rows() -> list[dict]:
    rows = []
    for s in range(N_SEQ):
        rows.append(dict(sequence_id=f"s{s}", score="full", design="none", correction="none",
                         budget=np.nan, seed=-1, correct=True, full_correct=True,
                         same_tokens_as_full=True, n_generated=5, fetch_scheduler=None,
                         fetch_budget=np.nan, fetch_bytes=np.nan, fetch_evicted_bytes=np.nan,
                         fetch_stall_ms=np.nan))
        for seed in (0, 1):
            for sched, budget, moved in (("none", 0.0, 0.0), ("random", 0.1, 100.0),
                                         ("certificate_bound", 0.1, 90.0)):
                ok = _correct(sched, s, seed)
                rows.append(dict(sequence_id=f"s{s}", score="snapkv", design="poisson",
                                 correction="hajek", budget=0.25, seed=seed, correct=ok,
                                 full_correct=True, same_tokens_as_full=ok, n_generated=5,
                                 fetch_scheduler=sched, fetch_budget=budget, fetch_bytes=moved,
                                 fetch_evicted_bytes=1000.0, fetch_stall_ms=moved / 100))
    return rows


def test_split_table_and_paired_tests():
    df = pd.DataFrame(_rows())
    plain, fetch = split_fetch_outcomes(df)
    # claims read the full cache and plain eviction (`none`) only, once per (policy, seed)
    assert set(plain["fetch_scheduler"].dropna()) == {"none"}
    assert len(plain) == N_SEQ + 2 * N_SEQ
    assert set(fetch["fetch_scheduler"]) == {"none", "random", "certificate_bound"}
    # without fetch columns everything is plain
    p2, f2 = split_fetch_outcomes(df.drop(columns=[c for c in df if c.startswith("fetch_")]))
    assert len(p2) == len(df) and f2.empty

    t = fetch_table(fetch).set_index("fetch_scheduler")
    assert t.loc["certificate_bound", "accuracy"] == pytest.approx(12 / 16)
    assert t.loc["random", "accuracy"] == pytest.approx(1 / 16)
    assert t.loc["random", "bytes_share"] == pytest.approx(0.1)      # 100 of 1000 per run
    assert t.loc["certificate_bound", "bytes_share"] == pytest.approx(0.09)
    assert t.loc["random", "mb_per_step"] == pytest.approx(100 / 4 / 1e6)  # 4 steps per run
    assert t.loc["random", "stall_ms_per_step"] == pytest.approx(1.0 / 4)
    assert t.loc["none", "bytes_share"] == 0

    c = compare_fetch(fetch, "certificate_bound", ("random", "none"))
    # `none` runs at budget 0 only: no shared budget, no row
    assert list(c["other"]) == ["random"]
    row = c.iloc[0]
    # per-sequence differences: 2-1 on s0, 2 on s1..s5, 0 on s6, s7
    assert (row["better"], row["worse"], row["n_sequences"]) == (6, 0, N_SEQ)
    assert row["mean_diff"] == pytest.approx((1 + 2 * 5) / N_SEQ)
    # exact sign-flip p: the patterns whose mean is >= the observed one among the 2^8
    d = np.array([1, 2, 2, 2, 2, 2, 0, 0], dtype=float)
    signs = np.array(np.meshgrid(*[[1, -1]] * 8)).reshape(8, -1).T
    expected = ((signs * d).mean(axis=1) >= d.mean() - 1e-15).mean()
    assert row["p_perm"] == pytest.approx(expected)
    assert row["p_holm"] == pytest.approx(expected) and bool(row["reject"])
    assert fetch_figure(fetch_table(fetch), 1.0)[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_evaluates_claims_on_plain_rows_and_adds_the_fetch_section(inputs, tmp_path):  # noqa: F811
    _, _, results, outcomes = inputs
    base = pq.read_table(outcomes / "outcomes.parquet").to_pandas()
    plain_report = build_report(results, outcomes, prereg_path=PREREG)
    # the same outcomes plus fetch runs of every evicting (policy, seed)
    extra = []
    for sched, budget in (("none", 0.0), ("random", 0.1), ("certificate_bound", 0.1)):
        f = base[base["score"] != "full"].copy()
        f["fetch_scheduler"], f["fetch_budget"] = sched, budget
        f["fetch_bytes"] = 1000.0 * budget
        f["fetch_evicted_bytes"], f["fetch_stall_ms"] = 1000.0, budget
        f["same_tokens_as_full"], f["n_generated"] = f["correct"], 6
        if sched == "random":
            f["correct"] = False   # would change every accuracy claim if it were counted
        extra.append(f)
    merged = pd.concat(extra, ignore_index=True)
    d = tmp_path / "outcomes"
    d.mkdir()
    pq.write_table(pa.Table.from_pandas(merged), d / "outcomes.parquet")
    (d / "summary.json").write_text(json.dumps({"prereg": {"sha256": prereg_hash(PREREG)}}))
    from tracesim.integrity import sign_results

    sign_results(d / "outcomes.parquet")
    report = build_report(results, d, prereg_path=PREREG)
    for a, b in zip(plain_report.claims, report.claims, strict=True):
        if a.claim in ("C2", "C3", "C4", "C6"):
            assert (a.estimate, a.pvalue) == pytest.approx((b.estimate, b.pvalue), nan_ok=True), \
                a.claim
    assert "fetch" in report.figures and report.captions["fetch"]
    assert any(k.startswith("in-loop fetches: accuracy") for k in report.tables)
    assert any(k.startswith("in-loop fetches: paired tests") for k in report.tables)
    assert "fetch" not in plain_report.figures
