"""GQA/output-space certificate, Poisson bootstrap and the coverage events."""

import numpy as np
import pytest

from tests.reference import output_space_reference
from tracesim import (
    bootstrap_certificate,
    hajek_attention,
    output_space_certificate,
    satterthwaite_covered,
    wald_covered,
)
from tracesim.interval_events import satterthwaite_quantile


def _layer(seed, n_heads=6, n_kv=2, N=40, d=8, n_q=3, hidden=20):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(n_heads, n_q, d))
    k = rng.normal(size=(n_kv, N, d))
    v = rng.normal(size=(n_kv, N, d))
    pi = np.ones((n_kv, N))
    pi[0, 4:] = 0.4
    pi[1, 4:] = rng.uniform(0.1, 0.9, size=N - 4)  # heads with different budgets and designs
    kept = rng.random((n_kv, N)) < pi
    w = rng.normal(size=(hidden, n_heads * d))
    return q, k, v, pi, kept, w


@pytest.mark.parametrize("seed", range(3))
def test_output_space_certificate_equals_brute_force(seed):
    q, k, v, pi, kept, w = _layer(seed)
    cert = output_space_certificate(q, k, v, pi, kept, w, scale=0.5)
    want = output_space_reference(q, k, v, pi, kept, w, 0.5)
    np.testing.assert_allclose(cert.variance_trace, want, rtol=1e-10)
    for h in range(q.shape[0]):
        est = hajek_attention(q[h], k[h // 3], v[h // 3], pi[h // 3], kept[h // 3], scale=0.5)
        np.testing.assert_allclose(cert.head_estimates[h], est.estimate, atol=1e-12)
    np.testing.assert_allclose(
        cert.output_estimate,
        sum(cert.head_estimates[h] @ w[:, h * 8:(h + 1) * 8].T for h in range(6)), atol=1e-10)
    assert "groups" in cert.summary()


def test_output_space_with_identity_projection_reduces_to_head_certificate():
    q, k, v, pi, kept, _ = _layer(4, n_heads=2, n_kv=2, hidden=16)
    cert = output_space_certificate(q, k, v, pi, kept, np.eye(16))
    for g in range(2):
        res = hajek_attention(q[g], k[g], v[g], pi[g], kept[g])
        np.testing.assert_allclose(cert.group_variance[g], res.variance_trace, rtol=1e-12)


def test_output_space_rejects_bad_shapes():
    q, k, v, pi, kept, w = _layer(0)
    with pytest.raises(ValueError, match="columns, expected 48"):
        output_space_certificate(q, k, v, pi, kept, w[:, :10])
    with pytest.raises(ValueError, match="cannot share"):
        output_space_certificate(q[:5], k, v, pi, kept, w[:, :40])


def test_bootstrap_agrees_with_linearization_for_large_tails():
    rng = np.random.default_rng(5)
    N, d = 600, 8
    k, v, q = rng.normal(size=(N, d)), rng.normal(size=(N, d)), rng.normal(size=(2, d)) * 0.5
    pi = np.full(N, 0.3)
    kept = rng.random(N) < pi
    lin = hajek_attention(q, k, v, pi, kept).variance_trace
    boot = bootstrap_certificate(q, k, v, pi, kept, n_replicates=400, seed=1)
    np.testing.assert_allclose(boot, lin, rtol=0.15)
    again = bootstrap_certificate(q, k, v, pi, kept, n_replicates=400, seed=1)
    np.testing.assert_array_equal(boot, again)


def test_wald_and_satterthwaite_events_on_hand_made_estimates():
    rng = np.random.default_rng(6)
    k, v, q = rng.normal(size=(30, 3)), rng.normal(size=(30, 3)), rng.normal(size=3)
    pi = np.full(30, 0.5)
    pi[:2] = 1
    res = hajek_attention(q, k, v, pi, rng.random(30) < pi, variance="full")
    # An error exactly at the boundary is covered, a bit beyond it is not.
    half = 1.959963984540054 * np.sqrt(res.variance_diag)
    assert wald_covered(res, res.estimate - 0.999 * half).all()
    assert not wald_covered(res, res.estimate - 1.001 * half).any()
    quant = satterthwaite_quantile(res.variance_trace, res.variance_trace_sq, 0.05)
    direction = np.ones(3) / np.sqrt(3)
    assert satterthwaite_covered(res, res.estimate + 0.999 * np.sqrt(quant) * direction)
    assert not satterthwaite_covered(res, res.estimate + 1.001 * np.sqrt(quant) * direction)
    # Small-sample intervals are wider.
    assert satterthwaite_covered(res, res.estimate + 1.001 * np.sqrt(quant) * direction,
                                 small_sample=True)


def test_satterthwaite_quantile_reduces_to_chi2_for_isotropic_variance():
    from scipy import stats

    # V = sigma^2 I_d: a = sigma^2, nu = d, so the quantile is sigma^2 chi2_d.
    d, sigma2 = 7, 0.3
    q = satterthwaite_quantile(np.array([d * sigma2]), np.array([d * sigma2**2]), 0.1)
    assert q[0] == pytest.approx(sigma2 * stats.chi2.ppf(0.9, d))
    assert satterthwaite_quantile(np.array([0.0]), np.array([0.0]), 0.1)[0] == 0.0


def test_coverage_requires_the_variance_it_needs():
    rng = np.random.default_rng(0)
    k, v, q = rng.normal(size=(5, 2)), rng.normal(size=(5, 2)), rng.normal(size=2)
    res = hajek_attention(q, k, v, np.ones(5), variance="trace")
    with pytest.raises(ValueError, match="variance_diag"):
        wald_covered(res, res.estimate)
    with pytest.raises(ValueError, match="tr\\(V\\^2\\)"):
        satterthwaite_covered(res, res.estimate)
