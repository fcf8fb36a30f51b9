"""Analyses checked on synthetic data with known answers."""

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score
from statsmodels.stats.nonparametric import rank_compare_2indep
from statsmodels.stats.weightstats import ttost_paired
from tracesim.analysis import (
    calibration_curve,
    cluster_coverage,
    delong_auc,
    delong_paired_test,
    holm,
    paired_noninferiority,
    paired_tost,
)


@pytest.mark.parametrize("seed", range(4))
def test_delong_variance_matches_statsmodels_rank_compare(seed):
    rng = np.random.default_rng(seed)
    pos = np.round(rng.normal(0.7, size=25 + seed), 1)  # rounding creates ties
    neg = np.round(rng.normal(0.0, size=40 - seed), 1)
    res = delong_auc(np.r_[pos, neg], np.r_[np.ones(pos.size), np.zeros(neg.size)])
    ref = rank_compare_2indep(pos, neg)
    assert res.auc == pytest.approx(ref.prob1, abs=1e-12)
    assert res.variance == pytest.approx(ref.var_prob, rel=1e-10)
    assert res.auc == pytest.approx(roc_auc_score(np.r_[np.ones(pos.size), np.zeros(neg.size)],
                                                  np.r_[pos, neg]))
    assert "AUC" in res.summary()


def test_independent_signal_gives_auc_half_and_nominal_rejection_rate():
    rng = np.random.default_rng(0)
    aucs, rejections, reps = [], 0, 400
    for _ in range(reps):
        y = rng.random(200) < 0.3
        a, b = rng.normal(size=200), rng.normal(size=200)
        aucs.append(delong_auc(a, y).auc)
        rejections += delong_paired_test(a, b, y).pvalue < 0.05
    assert abs(np.mean(aucs) - 0.5) < 0.01
    rate = rejections / reps
    # Binomial(400, 0.05): 4 SE is about 0.044.
    assert abs(rate - 0.05) < 0.044, rate


def test_paired_delong_detects_a_better_signal():
    rng = np.random.default_rng(1)
    y = rng.random(400) < 0.4
    strong = y + rng.normal(scale=0.7, size=400)
    weak = y + rng.normal(scale=3.0, size=400)
    res = delong_paired_test(strong, weak, y)
    assert res.difference > 0 and res.pvalue < 1e-3 and res.ci_low > 0
    same = delong_paired_test(strong, strong * 2 + 1, y)  # same ranking
    assert same.difference == 0 and same.pvalue == 1.0


def test_auc_input_errors():
    with pytest.raises(ValueError, match="at least one positive"):
        delong_auc([1.0, 2.0], [1, 1])
    with pytest.raises(ValueError, match="0/1"):
        delong_auc([1.0, 2.0], [1, 2])


def test_tost_matches_statsmodels_and_decides_correctly():
    rng = np.random.default_rng(2)
    a = rng.normal(size=60)
    b = a + rng.normal(0.01, 0.1, size=60)
    res = paired_tost(a, b, 0.05)
    ref_p = ttost_paired(a, b, -0.05, 0.05)[0]
    assert res.pvalue == pytest.approx(ref_p, rel=1e-10)
    assert res.supported and res.ci_low > -0.05 and res.ci_high < 0.05
    far = paired_tost(a, a + 0.2 + rng.normal(0, 0.1, size=60), 0.05)
    assert not far.supported
    assert "paired TOST" in res.summary()


def test_tost_type_one_error_at_the_margin():
    rng = np.random.default_rng(3)
    rejections = 0
    for _ in range(400):
        b = rng.normal(size=50)
        a = b + 0.1 + rng.normal(scale=0.3, size=50)  # true difference exactly on the margin
        rejections += paired_tost(a, b, 0.1).supported
    assert rejections / 400 < 0.05 + 0.044


def test_noninferiority_both_directions():
    rng = np.random.default_rng(4)
    b = rng.normal(size=80)
    a = b - 0.01 + rng.normal(scale=0.05, size=80)
    assert paired_noninferiority(a, b, 0.05).supported
    assert not paired_noninferiority(a - 0.2, b, 0.05).supported
    err_a, err_b = np.abs(a), np.abs(b)
    assert paired_noninferiority(err_a, err_b, 0.05, higher_is_better=False).supported


def test_cluster_coverage_of_a_calibrated_certificate_is_nominal():
    rng = np.random.default_rng(5)
    n_clusters, per = 60, 50
    # Correlated within cluster: a cluster-level scale error, calibrated on average.
    clusters = np.repeat(np.arange(n_clusters), per)
    errors = rng.normal(size=n_clusters * per)
    covered = np.abs(errors) <= 1.959963984540054
    res = cluster_coverage(covered, clusters)
    assert res.ci_low[0] < 0.95 < res.ci_high[0]
    lv, emp = calibration_curve(errors)
    assert np.abs(emp - lv).max() < 0.03


def test_cluster_robust_interval_is_wider_under_within_cluster_correlation():
    rng = np.random.default_rng(6)
    clusters = np.repeat(np.arange(40), 100)
    scale = np.repeat(rng.choice([0.6, 1.6], size=40), 100)  # whole clusters mis-calibrated
    covered = np.abs(rng.normal(size=4000) * scale) <= 1.96
    robust = cluster_coverage(covered, clusters)
    naive = cluster_coverage(covered, np.arange(4000))
    assert (robust.ci_high - robust.ci_low)[0] > 1.5 * (naive.ci_high - naive.ci_low)[0]


def test_strata_and_degenerate_strata():
    covered = np.r_[np.ones(30, bool), np.zeros(10, bool), np.ones(20, bool)]
    clusters = np.arange(60) % 6
    strata = np.r_[np.full(40, "m<8"), np.full(20, "m>=8")]
    res = cluster_coverage(covered, clusters, strata)
    assert res.strata == ["m<8", "m>=8"]
    assert res.coverage[1] == 1.0 and res.ci_high[1] == 1.0 and res.ci_low[1] < 1.0
    assert "m>=8" in res.summary()


def test_holm_matches_definition():
    out = holm({"C1": 0.01, "C2": 0.04, "C3": 0.03, "C4": float("nan")})
    assert set(out) == {"C1", "C2", "C3"}
    assert out["C1"] == (pytest.approx(0.03), True)
    assert out["C3"][0] == pytest.approx(0.06) and not out["C3"][1]
    assert out["C2"][0] == pytest.approx(0.06)


def test_prereg_loads_validates_and_guards_its_hash(tmp_path):
    from pathlib import Path

    from tracesim.analysis.prereg import (
        PreregChangedError,
        check_prereg_hash,
        load_prereg,
    )

    src = Path(__file__).resolve().parents[1] / "data" / "prereg.yaml"
    pre = load_prereg(src)
    assert set(pre.claims) == {f"C{i}" for i in range(13)}
    assert pre.claims["C1"]["primary_event"] == "wald" and pre.claim_alpha("C2") == 0.05
    assert check_prereg_hash(pre, pre.sha256)
    copy = tmp_path / "prereg.yaml"
    copy.write_text(src.read_text().replace("margin: 0.02 ", "margin: 0.03 "))
    changed = load_prereg(copy)
    with pytest.raises(PreregChangedError, match="changed after the results"):
        check_prereg_hash(changed, pre.sha256)
    assert check_prereg_hash(changed, pre.sha256, allow_change=True) is False
    bad = tmp_path / "bad.yaml"
    bad.write_text(src.read_text().replace("primary_event: wald", "primary_event: nope"))
    with pytest.raises(ValueError, match=r"bad.yaml: claims.C1.primary_event"):
        load_prereg(bad)
    bad.write_text("alpha: 2\nclaims: {}\n")
    with pytest.raises(ValueError, match=r"alpha: expected a number in \(0, 1\)"):
        load_prereg(bad)
    bad.write_text("!!python/object/apply:os.system ['true']\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_prereg(bad)


def test_cluster_bootstrap_auc_widens_under_within_cluster_dependence():
    from tracesim.analysis.auc import cluster_bootstrap_auc

    rng = np.random.default_rng(8)
    # Independent cases: bootstrap SE close to DeLong's.
    y = rng.random(600) < 0.4
    s = y * 0.8 + rng.normal(size=600)
    boot = cluster_bootstrap_auc(s, y, np.arange(600), n_boot=400, seed=1)
    delong = delong_auc(s, y)
    assert boot.estimate == pytest.approx(delong.auc)
    assert 0.8 < boot.se / delong.se < 1.25
    # 30 clusters of 20 identical-ish runs: the effective sample is ~30, not 600.
    cl = np.repeat(np.arange(30), 20)
    yc = np.repeat(rng.random(30) < 0.4, 20)
    sc = np.repeat(yc[::20] * 0.8 + rng.normal(size=30), 20) + rng.normal(scale=0.05, size=600)
    boot_c = cluster_bootstrap_auc(sc, yc, cl, n_boot=400, seed=1)
    assert boot_c.se > 2.5 * delong_auc(sc, yc).se
    # Paired difference of a signal with itself is exactly 0.
    same = cluster_bootstrap_auc(s, y, np.arange(600) % 50, scores_b=s, n_boot=50)
    assert same.estimate == 0.0 and same.ci_low == 0.0 and same.ci_high == 0.0
    assert "cluster-bootstrap" in boot.summary()
