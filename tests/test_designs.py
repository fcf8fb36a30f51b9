"""Inclusion designs: exactness of capped PPS, the other designs, validation."""

import numpy as np
import pytest

from tests.reference import capped_pps_iterative
from tracesim import Bernoulli, OrderSampling, PoissonPPS, TopK, inclusion_probabilities
from tracesim.designs import make_design
from tracesim.prn import permanent_uniforms


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("frac", [0.02, 0.1, 0.5, 0.9])
def test_capped_pps_sums_to_n_and_matches_iterative(seed, frac):
    rng = np.random.default_rng(seed)
    x = rng.lognormal(sigma=2.0, size=300)
    n = frac * x.size
    pi = inclusion_probabilities(x, n)
    assert pi.sum() == pytest.approx(n, rel=1e-12)
    assert (pi <= 1).all() and (pi > 0).all()
    np.testing.assert_allclose(pi, capped_pps_iterative(x, n), rtol=1e-10, atol=1e-14)
    order = np.argsort(x)
    assert (np.diff(pi[order]) >= -1e-15).all()  # monotone in the score
    uncapped = pi < 1
    ratio = pi[uncapped] / x[uncapped]
    np.testing.assert_allclose(ratio, ratio[0], rtol=1e-10)  # proportional below the cap


def test_capped_pps_example_and_extremes():
    np.testing.assert_allclose(inclusion_probabilities([4.0, 1, 1, 1, 1], 2.0),
                               [1, 0.25, 0.25, 0.25, 0.25])
    np.testing.assert_array_equal(inclusion_probabilities([1.0, 2.0, 3.0], 3), [1, 1, 1])
    pi = inclusion_probabilities([1e-300, 1.0, 1e300], 1.5)
    assert pi.sum() == pytest.approx(1.5) and np.isfinite(pi).all()


@pytest.mark.parametrize("mixture", [0.1, 0.5, 1.0])
def test_mixture_bounds_probabilities_below(mixture):
    x = np.random.default_rng(1).lognormal(sigma=3, size=500)
    n = 50.0
    pi = inclusion_probabilities(x, n, mixture=mixture)
    assert pi.sum() == pytest.approx(n)
    # c >= n/N after mixing (capping only raises c), so pi_i >= lambda * n / N.
    assert pi.min() >= mixture * n / x.size * (1 - 1e-12)
    if mixture == 1.0:
        np.testing.assert_allclose(pi, n / x.size)


def test_floor_is_respected_and_exact():
    x = np.random.default_rng(2).lognormal(sigma=2, size=400)
    pi = inclusion_probabilities(x, 40.0, floor=0.05)
    assert pi.min() == pytest.approx(0.05)
    assert pi.sum() == pytest.approx(40.0, rel=1e-12)
    assert (pi <= 1).all()
    # zero scores sit at the floor
    pi0 = inclusion_probabilities(np.r_[np.zeros(10), x[:90]], 20.0, floor=0.01)
    np.testing.assert_allclose(pi0[:10], 0.01)


@pytest.mark.parametrize(
    ("scores", "n", "kw", "match"),
    [
        ([1.0, 2.0], 0, {}, "must be > 0"),
        ([1.0, 2.0], -1, {}, "must be > 0"),
        ([1.0, 2.0], 3, {}, "exceeds the number of tail tokens"),
        ([1.0, -2.0], 1, {}, r"scores\[1\] = -2.0"),
        ([1.0, np.nan], 1, {}, "must be finite"),
        ([0.0, 0.0], 1, {}, "all zero"),
        ([1.0, 0.0, 0.0], 2, {}, "cannot be reached"),
        ([1.0, 2.0], 1, {"mixture": 1.5}, "mixture"),
        ([1.0, 2.0, 3.0], 1, {"floor": 0.5}, "infeasible"),
        ([], 1, {}, "empty"),
        ([[1.0]], 1, {}, "one-dimensional"),
    ],
)
def test_capped_pps_errors(scores, n, kw, match):
    with pytest.raises(ValueError, match=match):
        inclusion_probabilities(scores, n, **kw)


def test_all_zero_scores_allowed_with_full_mixture():
    np.testing.assert_allclose(inclusion_probabilities(np.zeros(4), 2.0, mixture=1.0), 0.5)


def test_poisson_kept_sets_nest_across_budgets():
    x = np.random.default_rng(3).lognormal(size=1000)
    u = permanent_uniforms(11, 2, 1, np.arange(1000))
    design = PoissonPPS(mixture=0.1)
    previous = np.zeros(1000, dtype=bool)
    for n in (10, 50, 100, 400, 900):
        _, kept = design.sample(x, n, u)
        assert (kept | ~previous).all()  # previous subset of kept
        previous = kept


def test_poisson_realized_size_matches_expectation():
    x = np.random.default_rng(4).lognormal(size=2000)
    pi = PoissonPPS().inclusion_probabilities(x, 200)
    sizes = [PoissonPPS().select(pi, permanent_uniforms(s, 0, 0, np.arange(2000))).sum()
             for s in range(300)]
    se = np.sqrt((pi * (1 - pi)).sum() / 300)
    assert abs(np.mean(sizes) - 200) < 4 * se


def test_bernoulli_is_uniform():
    pi = Bernoulli().inclusion_probabilities(np.arange(10.0) + 1, 2.5)
    np.testing.assert_allclose(pi, 0.25)
    assert Bernoulli.randomized and Bernoulli.variance == "poisson"


def test_topk_is_deterministic_and_prefers_recent_on_ties():
    design = TopK()
    pi = design.inclusion_probabilities([1.0, 3.0, 3.0, 0.0, 5.0, 3.0], 3)
    np.testing.assert_array_equal(pi, [0, 0, 1, 0, 1, 1])
    kept = design.select(pi, np.random.default_rng(0).random(6))
    np.testing.assert_array_equal(kept, pi == 1)
    assert not TopK.randomized and TopK.variance is None


@pytest.mark.parametrize("kind", ["pareto", "sequential"])
def test_order_sampling_has_fixed_size_and_approximate_pi(kind):
    rng = np.random.default_rng(5)
    x = rng.lognormal(sigma=1.0, size=60)
    design = OrderSampling(kind=kind, mixture=0.1)
    target = design.inclusion_probabilities(x, 12)
    counts = np.zeros(60)
    reps = 4000
    for s in range(reps):
        kept = design.select(target, permanent_uniforms(s, 0, 0, np.arange(60)))
        assert kept.sum() == 12
        counts += kept
    empirical = counts / reps
    # Pareto's first-order inclusion probabilities are very close to the targets; sequential
    # Poisson's less so. Bounds are several Monte Carlo standard errors plus the known bias.
    tol = 0.03 if kind == "pareto" else 0.06
    assert np.abs(empirical - target).max() < tol


def test_order_sampling_needs_integer_size():
    with pytest.raises(ValueError, match="integer sample size"):
        OrderSampling().inclusion_probabilities(np.ones(10), 2.5)


def test_registry_and_validated_hyperparameters():
    assert isinstance(make_design("poisson", mixture=0.2), PoissonPPS)
    assert isinstance(make_design("fixed", kind="sequential"), OrderSampling)
    with pytest.raises(ValueError, match="unknown design 'nope'"):
        make_design("nope")
    with pytest.raises(ValueError, match="PoissonPPS.mixture"):
        PoissonPPS(mixture=2.0)
    with pytest.raises(ValueError, match="OrderSampling.kind"):
        OrderSampling(kind="x")
    with pytest.raises(ValueError, match="design 'topk'"):
        make_design("topk", mixture=0.1)
