"""The compiled Hájek estimator against the plain-numpy reference, plus stability and errors."""

import numpy as np
import pytest

from tests.reference import full_attention_reference, hajek_reference
from tracesim import full_attention, hajek_attention, inclusion_probabilities


def _population(seed, N=120, d=8, dv=8, n_q=3):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(n_q, d))
    k = rng.normal(size=(N, d))
    v = rng.normal(size=(N, dv))
    pi = np.ones(N)
    pi[4:N - 8] = inclusion_probabilities(rng.lognormal(size=N - 12), (N - 12) / 4, mixture=0.1)
    kept = rng.random(N) < pi
    return q, k, v, pi, kept


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("correction", [True, False])
def test_agrees_with_reference(seed, fixed, correction):
    q, k, v, pi, kept = _population(seed, dv=5)
    scale = 0.37
    res = hajek_attention(q, k, v, pi, kept, scale=scale, variance="full", correction=correction,
                          design_variance="fixed" if fixed else "poisson")
    for r in range(q.shape[0]):
        est, V, m = hajek_reference(q[r], k, v, pi, kept, scale, correction, fixed)
        np.testing.assert_allclose(res.estimate[r], est, rtol=0, atol=1e-10)
        np.testing.assert_allclose(res.variance[r], V, rtol=0, atol=1e-10)
        np.testing.assert_allclose(res.variance_diag[r], np.diag(V), rtol=0, atol=1e-10)
        assert res.variance_trace[r] == pytest.approx(np.trace(V), abs=1e-10)
        assert res.variance_trace_sq[r] == pytest.approx((V * V).sum(), abs=1e-10)
        assert res.tail_size[r] == m


def test_causal_query_positions_match_prefix_reference():
    q, k, v, pi, kept = _population(7, N=60)
    kept[:4] = True  # sinks
    positions = np.array([10, 35, 59])
    res = hajek_attention(q, k, v, pi, kept, query_positions=positions, variance="diag")
    for r, p in enumerate(positions):
        est, V, m = hajek_reference(q[r], k[:p + 1], v[:p + 1], pi[:p + 1], kept[:p + 1],
                                    q.shape[1] ** -0.5)
        np.testing.assert_allclose(res.estimate[r], est, atol=1e-10)
        assert res.variance_trace[r] == pytest.approx(np.trace(V), abs=1e-10)
        assert res.tail_population[r] == (pi[:p + 1] < 1).sum()


def test_single_query_is_squeezed_and_full_attention_is_exact():
    q, k, v, pi, kept = _population(1)
    res = hajek_attention(q[0], k, v, pi, kept)
    assert res.estimate.shape == (v.shape[1],) and np.ndim(res.variance_trace) == 0
    np.testing.assert_allclose(full_attention(q, k, v), np.stack(
        [full_attention_reference(x, k, v, q.shape[1] ** -0.5) for x in q]), atol=1e-12)
    all_kept = hajek_attention(q, k, v, np.ones(len(k)))
    np.testing.assert_array_equal(all_kept.variance_trace, 0.0)
    np.testing.assert_array_equal(all_kept.tail_size, 0)
    assert "Hájek" in all_kept.summary()


def test_float_inputs_of_lower_precision_are_accumulated_in_float64():
    q, k, v, pi, kept = _population(2)
    a = hajek_attention(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), pi, kept)
    b = hajek_attention(q.astype(np.float16).astype(np.float64), k.astype(np.float16).astype(
        np.float64), v.astype(np.float16).astype(np.float64), pi, kept)
    np.testing.assert_array_equal(a.estimate, b.estimate)


# --- stability: finite outputs or a clear error, never NaN -------------------------------------

def test_huge_logits_are_stable():
    rng = np.random.default_rng(0)
    k = rng.normal(size=(50, 4))
    v = rng.normal(size=(50, 4))
    for magnitude in (1e2, 1e4):
        q = rng.normal(size=(2, 4)) * magnitude
        pi = np.full(50, 0.5)
        res = hajek_attention(q, k, v, pi, np.arange(50) % 2 == 0, variance="full")
        assert np.isfinite(res.estimate).all() and np.isfinite(res.variance).all()
        assert np.isfinite(res.variance_trace).all()


def test_tiny_inclusion_probability_is_stable():
    rng = np.random.default_rng(1)
    k, v, q = rng.normal(size=(20, 4)), rng.normal(size=(20, 4)), rng.normal(size=4)
    pi = np.full(20, 0.5)
    pi[3] = 1e-9
    kept = np.ones(20, dtype=bool)
    res = hajek_attention(q, k, v, pi, kept, variance="full")
    assert np.isfinite(res.estimate).all() and np.isfinite(res.variance_trace)
    # The rare token carries almost all the Hájek weight: n_eff collapses towards 1.
    assert res.n_eff < 1.01


def test_single_kept_token_empty_tail_and_d1():
    rng = np.random.default_rng(2)
    k, v, q = rng.normal(size=(10, 1)), rng.normal(size=(10, 1)), rng.normal(size=1)
    pi = np.full(10, 0.3)
    kept = np.zeros(10, dtype=bool)
    kept[6] = True
    res = hajek_attention(q, k, v, pi, kept, variance="full")
    np.testing.assert_allclose(res.estimate, v[6])
    assert res.variance_trace == 0.0 and res.tail_size == 1
    assert res.small_sample_variance_trace() == np.inf  # m = 1: nothing to estimate from
    # empty tail (everything take-all): exact and zero variance, also for the small-sample form
    exact = hajek_attention(q, k, v, np.ones(10), variance="full")
    assert exact.tail_size == 0 and exact.small_sample_variance_trace() == 0.0
    # m = 0 but tail tokens exist: the primary certificate is 0 (a documented weakness)
    pi2 = np.ones(10)
    pi2[5:] = 0.2
    kept2 = np.r_[np.ones(5, bool), np.zeros(5, bool)]
    none = hajek_attention(q, k, v, pi2, kept2)
    assert none.tail_size == 0 and none.variance_trace == 0.0
    assert none.small_sample_variance_trace() == np.inf


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(pi=np.full(10, 1.5)), "must lie in"),
        (dict(pi=np.r_[0.0, np.ones(9)]), "kept but has inclusion probability 0"),
        (dict(kept=np.zeros(10, bool)), "sees no kept token"),
        (dict(k=np.ones((10, 3))), "columns, expected 4"),
        (dict(v=np.ones((9, 4))), "values has 9 rows"),
        (dict(q=np.full(4, np.nan)), "NaN or Inf"),
        (dict(variance="half"), "variance = 'half'"),
    ],
)
def test_input_errors(change, match):
    rng = np.random.default_rng(3)
    args = dict(q=rng.normal(size=4), k=rng.normal(size=(10, 4)), v=rng.normal(size=(10, 4)),
                pi=np.ones(10), kept=np.ones(10, bool), variance="diag")
    args.update(change)
    with pytest.raises(ValueError, match=match):
        hajek_attention(args["q"], args["k"], args["v"], args["pi"], args["kept"],
                        variance=args["variance"])


def test_inclusion_probabilities_exact_for_huge_scores():
    import tracesim

    pi = tracesim.inclusion_probabilities(np.full(512, 1e306), 64)
    assert pi.sum() == pytest.approx(64.0) and np.allclose(pi, 0.125)
    x = np.r_[np.full(256, 1e306), np.full(256, 1e305)]
    mixed = tracesim.inclusion_probabilities(x, 64, mixture=0.1)
    small = tracesim.inclusion_probabilities(x / 1e300, 64, mixture=0.1)
    assert mixed.sum() == pytest.approx(64.0)
    np.testing.assert_allclose(mixed, small, rtol=1e-12)
    assert mixed[0] > mixed[-1]  # the scores still matter under the mixture


@pytest.mark.parametrize("kwargs", [{"scale": np.nan}, {"scale": np.inf}, {"scale": -1.0},
                                    {"scale": 0.0}, {"query_positions": [-1]}])
def test_hajek_attention_rejects_bad_scale_and_positions(kwargs):
    from tracesim import hajek_attention

    rng = np.random.default_rng(0)
    k, v = rng.normal(size=(6, 4)), rng.normal(size=(6, 3))
    with pytest.raises(ValueError, match="scale|query_positions"):
        hajek_attention(rng.normal(size=4), k, v, np.ones(6), **kwargs)


def test_hajek_attention_rejects_zero_dimension():
    from tracesim import hajek_attention

    with pytest.raises(ValueError, match="d >= 1"):
        hajek_attention(np.zeros(0), np.zeros((3, 0)), np.ones((3, 2)), np.ones(3))
