"""The compiled per-step score (softmax rows of the group and their reduction) against numpy.

Ground truth: the numpy formula the kernel replaced (row maximum, exponentials, row sums, then
the mean or maximum over the group's heads). Another summation order and ``exp``
implementation, so the comparison is to 1e-12 relative, not bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.replay_fixtures import synthetic_trace
from tracesim.kernels.step_scores import group_softmax
from tracesim.policies import make_policy


def _numpy_scores(s: np.ndarray, reduce_max: bool) -> tuple[np.ndarray, np.ndarray]:
    w = np.exp(s - s.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return w, (w.max(axis=0) if reduce_max else w.mean(axis=0))


@pytest.mark.parametrize("reduce_max", [False, True])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_group_softmax_matches_numpy(reduce_max, n):
    rng = np.random.default_rng(n)
    s = rng.standard_normal((n, 300)) * 6.0
    s[:, 7] = 40.0  # a dominant token: exponentials of very different sizes
    w_ref, x_ref = _numpy_scores(s, reduce_max)
    x = np.empty(300)
    group_softmax(s, reduce_max, x)
    np.testing.assert_allclose(s, w_ref, rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(x, x_ref, rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(s.sum(axis=1), 1.0, rtol=1e-13)


@pytest.mark.parametrize("gqa", ["mean", "max"])
@pytest.mark.parametrize("proxy", ["exact", "quant:4"])
def test_perstep_scores_of_a_plain_layer_match_the_numpy_softmax(gqa, proxy):
    trace = synthetic_trace(4, n_heads=6, n_kv=2, d=16, P=96, prompt_length=80)
    pol = make_policy("perstep", "poisson", 0.3, schedule="step",
                      score_params={"proxy": proxy, "gqa": gqa})
    score = pol.score
    assert trace.is_plain
    ends = [int(p) for p, r in zip(trace.query_positions, trace.query_roles, strict=True)
            if r == "decode"]
    for g in range(trace.n_kv_heads):
        for end in ends:
            got = score.scores(trace, g, end)
            w = score._step_attention(trace, g, list(trace.group(g)), end)  # numpy path
            want = (w.max(axis=0) if gqa == "max" else w.mean(axis=0))[:end]
            assert got.shape == (end,)
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-300)
