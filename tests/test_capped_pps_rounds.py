"""Capped PPS without a floor by capping rounds: the scale of the sorted breakpoint sweep."""

import numpy as np
import pytest

from tests.test_kernel_fast_paths import _scores
from tracesim.kernels.inclusion import _scale_by_capping, _scale_by_sweep, capped_pps_scale


@pytest.mark.parametrize("kind", ["uniform", "ties", "wide", "sparse", "extremes"])
def test_capping_rounds_give_the_sweeps_scale(kind):
    rng = np.random.default_rng(23)
    settled = 0
    for _ in range(300):
        N = int(rng.integers(1, 400))
        x = _scores(rng, kind, N)
        xs = np.sort(x)
        prefix = np.concatenate([[0.0], np.cumsum(xs)])
        first = int(np.searchsorted(xs, 0.0, side="right"))
        for n in (rng.random() * N, float(rng.integers(1, N + 1)), 0.5):
            want = _scale_by_sweep(xs, prefix, first, n, 0.0)
            got = capped_pps_scale(x, n, 0.0)
            settled += bool(_scale_by_capping(x, n) == _scale_by_capping(x, n))
            if want < 0:
                assert got < 0, (kind, N, n)
                continue
            assert got == pytest.approx(want, rel=1e-12, abs=0.0), (kind, N, n)
    assert settled > 0  # the rounds, not only the sweep they fall back to, were tested


def test_capping_rounds_reach_the_budget_on_attention_like_scores():
    rng = np.random.default_rng(4)
    x = np.exp(rng.normal(0.0, 3.0, 4000))
    c = _scale_by_capping(x, 1000.0)
    assert c == c  # settled without the sweep
    assert np.minimum(c * x, 1.0).sum() == pytest.approx(1000.0, rel=1e-12)
    assert (c * x >= 1.0).any()  # some tokens are capped
