"""The claims table: a claim defined outside the package is registered with one call,
pre-registered in a file the test writes, and evaluated in the report and its claims.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tracesim.analysis.claim_registry import (
    BUILTIN_CLAIMS,
    claim_ids,
    register_claim,
    registered_claims,
    unregister_claim,
)
from tracesim.analysis.claims import (
    INCONCLUSIVE,
    NOT_EVALUATED,
    NOT_SUPPORTED,
    SUPPORTED,
    Claim,
    ClaimInputs,
    ClaimResult,
)
from tracesim.analysis.cluster import one_sided_bounds
from tracesim.analysis.prereg import load_prereg, prereg_hash
from tracesim.analysis.report import build_report, write_report

from tracesim.integrity import sign_results

PREREG = Path(__file__).resolve().parents[1] / "data" / "prereg.yaml"


def evaluate_c99(inputs: ClaimInputs) -> ClaimResult:
    """Share of correct answers of question-aware SnapKV at the pre-registered budget, with
    cluster-robust one-sided bounds by sequence, against the pre-registered floor."""
    entry = inputs.prereg.claims["C99"]
    alpha = inputs.prereg.claim_alpha("C99")
    res = ClaimResult("C99", entry["hypothesis"])
    df = inputs.outcomes
    df = df[(df["score"] == "snapkv") & (df["budget"] == entry["compare"]["budget"])]
    if df.empty:
        res.detail = f"no snapkv outcomes at budget {entry['compare']['budget']}"
        return res
    rate, lo, hi = one_sided_bounds(df["correct"].astype(float), df["sequence_id"], 1 - alpha)
    floor = float(entry["min_accuracy"])
    res.estimate, res.ci_low, res.ci_high = rate, lo, hi
    res.verdict = (SUPPORTED if lo >= floor else NOT_SUPPORTED if hi < floor else INCONCLUSIVE)
    res.detail = f"{len(df)} runs of {df['sequence_id'].nunique()} sequences; floor {floor}"
    return res


def check_c11(entry: dict, fail) -> None:
    if not 0 <= entry.get("min_accuracy", -1) <= 1:
        fail("claims.C99.min_accuracy", "expected a number in [0, 1]")


C99 = Claim("C99", evaluate_c99, "accuracy: share correct, question-aware SnapKV at 50 %",
            needs=("outcomes",), check=check_c11)

C99_ENTRY = """
  C99:
    hypothesis: Question-aware SnapKV at 50 % answers at least 30 % of the questions.
    metric: correct
    compare: {score: snapkv, budget: 0.5}
    test: cluster-robust (by sequence) one-sided bounds of the share correct
    alpha: 0.05
    min_accuracy: 0.3
    verdict: supported if the lower bound >= min_accuracy; not supported if the upper is below
"""


@pytest.fixture
def c11():
    register_claim(C99)
    yield C99
    unregister_claim("C99")


def _outcomes(root: Path, prereg: Path) -> Path:
    rng = np.random.default_rng(0)
    rows = []
    for s in range(10):
        for design, budget in (("topk", 0.5), ("poisson", 0.5)):
            certified = design == "poisson"
            cert = rng.gamma(2.0) if certified else np.nan
            correct = bool(rng.random() < 0.8)
            rows.append(dict(
                sequence_id=f"s{s}", config_id=f"snapkv|{design}|{budget}", score="snapkv",
                design=design, correction="hajek" if certified else "none", budget=budget,
                score_params=json.dumps({"question_aware": True}), certified=certified,
                correct=correct, full_correct=True,
                failure="none" if correct else "cache_induced",
                logprob_mean=-rng.gamma(1.0), certificate_mean=cert,
                certificate_max=cert * 2 if certified else np.nan))
    out = root / "outcomes"
    out.mkdir()
    pq.write_table(pa.Table.from_pandas(pd.DataFrame(rows)), out / "outcomes.parquet")
    (out / "summary.json").write_text(json.dumps({"prereg": {"sha256": prereg_hash(prereg)}}))
    sign_results(out / "outcomes.parquet")
    return out


def test_a_claim_from_outside_is_preregistered_and_evaluated_in_the_report(c11, tmp_path):
    prereg = tmp_path / "prereg.yaml"
    prereg.write_text(PREREG.read_text() + C99_ENTRY)
    assert claim_ids()[-1] == "C99" and load_prereg(prereg).claims["C99"]["min_accuracy"] == 0.3
    outcomes = _outcomes(tmp_path, prereg)
    report = build_report(None, outcomes, prereg_path=prereg)
    by_id = {c.claim: c for c in report.claims}
    assert [c.claim for c in report.claims] == [f"C{i}" for i in range(13)] + ["C99"]
    assert by_id["C99"].verdict in {SUPPORTED, NOT_SUPPORTED, INCONCLUSIVE}
    assert 0 < by_id["C99"].estimate <= 1 and by_id["C99"].ci_low <= by_id["C99"].estimate
    assert by_id["C1"].detail == "no replay results given"  # the built-ins are unchanged
    write_report(report, tmp_path / "report")
    saved = {c["claim"]: c for c in json.loads((tmp_path / "report" / "claims.json").read_text())}
    assert saved["C99"]["verdict"] == by_id["C99"].verdict
    assert saved["C99"]["estimate"] == by_id["C99"].estimate
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| C99 | Question-aware SnapKV at 50 %" in md and C99.units in md
    # Without the input it needs: listed, not evaluated, with the input it lacks.
    bare = build_report(None, None, prereg_path=prereg)
    assert {c.claim: c for c in bare.claims}["C99"].verdict == NOT_EVALUATED
    assert {c.claim: c for c in bare.claims}["C99"].detail == "no in-loop outcomes given"


def test_a_registered_claim_must_be_preregistered_and_pass_its_own_check(c11, tmp_path):
    with pytest.raises(ValueError, match=r"missing \['C99'\]"):
        load_prereg(PREREG)
    bad = tmp_path / "bad.yaml"
    bad.write_text(PREREG.read_text() + C99_ENTRY.replace("min_accuracy: 0.3",
                                                          "min_accuracy: 3"))
    with pytest.raises(ValueError, match="claims.C99.min_accuracy"):
        load_prereg(bad)


def test_the_registry_refuses_clashes_and_keeps_the_builtins():
    assert [c.id for c in registered_claims()] == [f"C{i}" for i in range(13)]
    assert all(c.units for c in BUILTIN_CLAIMS)  # every claim says what its estimate measures
    with pytest.raises(ValueError, match="already registered"):
        register_claim(BUILTIN_CLAIMS[1])
    with pytest.raises(ValueError, match="C and a number"):
        register_claim(Claim("X1", evaluate_c99, "x"))
    with pytest.raises(ValueError, match="needs"):
        register_claim(Claim("C98", evaluate_c99, "x", needs=("traces",)))
    with pytest.raises(ValueError, match="built in"):
        unregister_claim("C1")
    assert claim_ids() == [f"C{i}" for i in range(13)]
    load_prereg(PREREG)  # the shipped file pre-registers exactly the built-in claims
