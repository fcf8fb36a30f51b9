"""Validity rule (C8) and the frontier on small synthetic results tables."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import statsmodels.api as sm
from tracesim.analysis.claims import NOT_EVALUATED
from tracesim.analysis.cluster import cluster_proportions
from tracesim.analysis.coverage import cluster_coverage
from tracesim.analysis.frontier import _versus_topk, frontier_table
from tracesim.analysis.prereg import load_prereg, prereg_hash
from tracesim.analysis.validity import (
    SplitSettings,
    ValidityRuleError,
    check_rules,
    fit_rule,
    fit_rules,
    ids_hash,
    load_rules,
    save_rules,
    split_sequences,
)

from tests.frontier_fixtures import synthetic_results

PREREG = Path(__file__).resolve().parents[1] / "data" / "prereg.yaml"
SETTINGS = SplitSettings.from_claim(load_prereg(PREREG).claims["C8"])


@pytest.fixture(scope="module")
def results():
    return synthetic_results(n_seq=24, seeds=3, weight=True)


def test_split_is_deterministic_disjoint_and_independent_of_other_ids():
    ids = [f"passkey-L1024-s0-{i:04d}" for i in range(2000)]
    a = split_sequences(ids, "salt", 0.5)
    assert a == split_sequences(list(reversed(ids)), "salt", 0.5)
    calib = {s for s, c in a.items() if c}
    held = {s for s, c in a.items() if not c}
    assert not calib & held and calib | held == set(ids)
    assert 0.45 < len(calib) / len(ids) < 0.55
    # A sequence's side does not depend on which other sequences are present.
    sub = split_sequences(ids[:37], "salt", 0.5)
    assert all(sub[s] == a[s] for s in sub)
    # Another salt gives another split; fraction is monotone (nested calibration sets).
    assert split_sequences(ids, "other", 0.5) != a
    small = {s for s, c in split_sequences(ids, "salt", 0.2).items() if c}
    assert small < calib


def test_rule_is_fit_only_on_calibration_sequences(results):
    cfg = results[results["certified"]]["config_id"].iloc[0]
    g = results[results["config_id"] == cfg]
    rule = fit_rule(g, SETTINGS, cfg)
    split = split_sequences(g["sequence_id"].unique(), SETTINGS.salt, SETTINGS.fraction)
    assert set(rule.calibration_ids) == {s for s, c in split.items() if c}
    assert rule.calibration_hash == ids_hash(rule.calibration_ids)
    # Scrambling every held-out row changes nothing in the fitted rule.
    held = ~g["sequence_id"].map(split)
    scrambled = g.copy()
    scrambled.loc[held, "wald_cov"] = 0.0
    scrambled.loc[held, "n_eff"] = 1e6
    assert fit_rule(scrambled, SETTINGS, cfg) == rule
    # The selection rule: calibration coverage reaches nominal with the largest certified share.
    assert rule.reached and rule.calibration_coverage >= SETTINGS.nominal
    cal = g[g["sequence_id"].map(split)]
    m = rule.mask(cal)
    assert np.isclose(cal["wald_cov"][m].mean(), rule.calibration_coverage)
    assert np.isclose(m.mean(), rule.calibration_certified)


def test_a_rule_fit_on_held_out_sequences_is_refused(results, tmp_path):
    rules, _ = fit_rules(results, SETTINGS)
    split = split_sequences(results["sequence_id"].unique(), SETTINGS.salt, SETTINGS.fraction)
    held = sorted(s for s, c in split.items() if not c)
    check_rules(rules, SETTINGS, held)  # the honest rules pass
    cid, rule = next(iter(rules.items()))
    leaked = replace(rule, calibration_ids=tuple(sorted(rule.calibration_ids + (held[0],))),
                     calibration_hash=ids_hash(rule.calibration_ids + (held[0],)))
    with pytest.raises(ValidityRuleError, match="fit on held-out sequences"):
        check_rules({cid: leaked}, SETTINGS, held)
    # A rule fitted with another salt (i.e. on another split) is refused as well.
    other = fit_rule(results[results["config_id"] == cid], replace(SETTINGS, salt="x"), cid)
    with pytest.raises(ValidityRuleError, match="salt"):
        check_rules({cid: other}, SETTINGS, held)
    # Ids edited without their hash are refused.
    with pytest.raises(ValidityRuleError, match="altered"):
        check_rules({cid: replace(rule, calibration_ids=rule.calibration_ids[1:])}, SETTINGS,
                    held)
    # Through the report: a rule file fitted on held-out sequences stops it with a clear error.
    from tracesim.analysis.report import build_report

    from tracesim.app.cli import main

    res_dir = tmp_path / "res"
    res_dir.mkdir()
    pq.write_table(pa.Table.from_pandas(results), res_dir / "results.parquet")
    (res_dir / "summary.json").write_text(json.dumps({"prereg": {"sha256":
                                                                 prereg_hash(PREREG)}}))
    from tracesim.integrity import sign_results

    sign_results(res_dir / "results.parquet")
    bad = tmp_path / "frontier"
    bad.mkdir()
    save_rules(bad / "validity_rules.json", {cid: leaked}, SETTINGS)
    with pytest.raises(ValidityRuleError, match="held-out"):
        build_report(res_dir, None, prereg_path=PREREG, frontier_dir=bad)
    assert main(["report", str(res_dir), "--frontier", str(bad), "--out",
                 str(tmp_path / "r")]) == 2
    assert main(["frontier", str(res_dir), "--rules", str(bad / "validity_rules.json"),
                 "--out", str(tmp_path / "f")]) == 2


def test_cluster_proportions_match_the_closed_form_and_statsmodels_gee():
    # Constructed: 3 clusters with known sums.
    y = np.array([1, 1, 0, 1, 1, 1, 1, 0, 0, 1], dtype=float)
    g = np.array([0, 0, 0, 1, 1, 1, 1, 2, 2, 2])
    res = cluster_proportions(y, g, alpha=0.05).loc["all"]
    p = 0.7
    meat = (2 - 3 * p) ** 2 + (4 - 4 * p) ** 2 + (1 - 3 * p) ** 2
    se = np.sqrt(meat) / (10 * p * (1 - p))
    b = np.log(p / (1 - p))
    assert res["estimate"] == pytest.approx(p)
    assert res["se_logit"] == pytest.approx(se)
    assert res["ci_low"] == pytest.approx(1 / (1 + np.exp(-(b - 1.959963984540054 * se))))
    assert res["ci_high"] == pytest.approx(1 / (1 + np.exp(-(b + 1.959963984540054 * se))))
    fit = sm.GEE(y, np.ones((10, 1)), groups=g, family=sm.families.Binomial(),
                 cov_struct=sm.cov_struct.Independence()).fit()
    assert float(fit.bse[0]) == pytest.approx(se, rel=1e-6)
    # Random strata, fractional events: same intervals as the statsmodels-based C1 helper.
    rng = np.random.default_rng(1)
    n = 600
    clusters = rng.integers(0, 15, n)
    strata = rng.choice(["a", "b", "c"], n)
    ev = (rng.random(n) < 0.8 + 0.05 * (clusters % 3)).astype(float)
    ev[::7] = 0.5
    fast = cluster_proportions(ev, clusters, strata)
    ref = cluster_coverage(ev, clusters, strata)
    np.testing.assert_allclose(fast["estimate"], ref.coverage)
    np.testing.assert_allclose(fast["ci_low"], ref.ci_low, rtol=1e-6)
    np.testing.assert_allclose(fast["ci_high"], ref.ci_high, rtol=1e-6)
    # Degenerate stratum: all covered -> Clopper-Pearson, as cluster_coverage does.
    allc = cluster_proportions(np.ones(20), np.arange(20) % 4)
    assert allc["ci_high"].iloc[0] == 1.0 and allc["ci_low"].iloc[0] == pytest.approx(
        cluster_coverage(np.ones(20), np.arange(20) % 4).ci_low[0])


def test_error_versus_topk_interpolates_log_error_in_memory():
    t = pd.DataFrame({
        "family": ["k"] * 3 + ["p", "p"], "budget": [0.1, 0.2, 0.4, 0.3, 0.9],
        "design": ["topk"] * 3 + ["poisson"] * 2, "memory": [10.0, 20, 40, 30, 90],
        "err2": [4.0, 2, 1, 1.5, 0.1],
        "config_id": [f"s(w=1)|{d}(x)|c|uniform:{b}|oneshot" for d, b in
                      [("topk", 0.1), ("topk", 0.2), ("topk", 0.4), ("poisson", 0.3),
                       ("poisson", 0.9)]]})
    r = _versus_topk(t)
    np.testing.assert_allclose(r[:3], 1.0)
    assert r[3] == pytest.approx(1.5 / np.sqrt(2))
    assert np.isnan(r[4])  # beyond the top-k curve: no extrapolation


def test_frontier_files_are_written_and_readable(tmp_path):
    from tracesim.app.cli import main

    df = synthetic_results(n_seq=12, seeds=1, bound=True)
    res = tmp_path / "results.parquet"
    pq.write_table(pa.Table.from_pandas(df), res)
    out = tmp_path / "front"
    assert main(["frontier", str(res), "--out", str(out)]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == ["frontier.md", "frontier.parquet", "frontier.png", "validity_rules.json"]
    table = pq.read_table(out / "frontier.parquet").to_pandas()
    overall = table[table["stratum_kind"] == "all"]
    assert set(overall["variant"]) == {"wald", "wald_t", "ruled", "bound"}
    assert set(table["stratum_kind"]) == {"all", "m", "n_eff", "layer", "head", "query_role",
                                          "task"}
    bound = overall[overall["variant"] == "bound"]
    assert (bound["coverage"] == 1).all() and (bound["tightness_median"] >= 2).all()
    wald = overall[overall["variant"] == "wald"]
    # Memory includes the summaries; top-k is its own reference.
    assert np.allclose(overall[overall["design"] == "topk"]["err_vs_topk"], 1.0)
    assert (wald["memory"] > 16 + 0.09 * 1024).all()
    assert (out / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "frontier.md").read_text()
    assert "## Aim at 25% budget" in md and "| ruled |" in md.replace("ruled |", "ruled |")
    rules = load_rules(out / "validity_rules.json")
    assert len(rules) == 3 and all(r.calibration_ids for r in rules.values())
    # Missing optional columns: variants skipped with a note, no crash.
    t2, notes = frontier_table(df.drop(columns=["bound2", "bound_cov", "summary_tokens"]))
    assert "bound" not in set(t2["variant"]) and any("bound_cov" in n for n in notes)
    assert main(["frontier", str(tmp_path / "nothing"), "--out", str(out)]) == 2


def test_c8_verdict_and_fraction_certified(results):
    from tracesim.analysis.claims_c8 import evaluate_c8

    prereg = load_prereg(PREREG)
    c8, rules = evaluate_c8(results, prereg)
    assert c8.verdict != NOT_EVALUATED, c8.detail
    assert 0 < c8.extra["fraction_certified"] < 1 and "fraction certified" in c8.detail
    assert 0.9 < c8.estimate <= 1 and 0 <= c8.pvalue <= 1 and len(rules) == 3
    # Same rules given back (as from a frontier's rule file): same claim.
    again, _ = evaluate_c8(results, prereg, rules)
    assert again.estimate == c8.estimate and again.pvalue == c8.pvalue


def test_prereg_c8_errors_name_the_field(tmp_path):
    text = PREREG.read_text()
    bad = tmp_path / "p.yaml"
    bad.write_text(text.replace("calibration_fraction: 0.5", "calibration_fraction: 1.5"))
    with pytest.raises(ValueError, match="claims.C8.split.calibration_fraction"):
        load_prereg(bad)
    bad.write_text(text.replace("interval: [0.93, 0.97]", "interval: [0.97, 0.93]"))
    with pytest.raises(ValueError, match="claims.C8.interval"):
        load_prereg(bad)


def test_study_specs_are_valid_grids_pointed_at_the_study_traces(tmp_path):
    from tracesim.app.study import SPECS, study_spec
    from tracesim.policies.grid import parse_grid

    for name in SPECS:
        spec = study_spec(name, tmp_path / "out", tmp_path / "traces")
        assert all(s["path"].startswith(str((tmp_path / "traces").resolve()))
                   for s in spec["store"])
        assert spec["output"] == str((tmp_path / "out" / f"sweep-{name}").resolve())
        assert spec["record"] == "per_seed"  # the validity rule reads per-draw m, n_eff
        assert parse_grid(spec["grid"], where=name)


def test_c8_leaves_the_per_step_rows_to_c9(results):
    from tracesim.analysis.claims_c8 import evaluate_c8

    prereg = load_prereg(PREREG)
    base = results if "schedule" in results else results.assign(schedule="oneshot")
    c8, _ = evaluate_c8(base, prereg)
    # per-step rows of the same design and correction, every one uncovered: C8 must not move
    step = base.assign(schedule="step", score="perstep", wald_cov=0.0)
    both, _ = evaluate_c8(pd.concat([base, step], ignore_index=True), prereg)
    assert (both.estimate, both.pvalue, both.detail) == (c8.estimate, c8.pvalue, c8.detail)
