"""The replay's fast paths reproduce the reference code paths they replace, bit for bit."""

import numpy as np
import pytest

from tracesim.kernels.inclusion import _scale_by_sweep, _scale_without_floor
from tracesim.kernels.replay_events import gather_by_rule, gather_kept
from tracesim.prn import permanent_uniforms, step_stream, step_uniforms_into


def _scores(rng, kind, N):
    if kind == "uniform":
        return rng.random(N)
    if kind == "ties":  # repeated values and zeros
        return rng.integers(0, 4, N).astype(np.float64)
    if kind == "wide":  # scores spanning many orders of magnitude
        return np.exp(rng.normal(0.0, 30.0, N))
    if kind == "sparse":
        x = rng.random(N) ** 8
        x[rng.random(N) < 0.3] = 0.0
        return x
    return rng.choice([5e-324, 1e-310, 1.0, 3.0, 1e300, 0.0], N)  # extremes


@pytest.mark.parametrize("kind", ["uniform", "ties", "wide", "sparse", "extremes"])
def test_capped_pps_without_floor_is_the_sorted_breakpoint_sweep(kind):
    rng = np.random.default_rng(11)
    for _ in range(300):
        N = int(rng.integers(1, 200))
        xs = np.sort(_scores(rng, kind, N))
        prefix = np.concatenate([[0.0], np.cumsum(xs)])
        first = int(np.searchsorted(xs, 0.0, side="right"))
        for n in (rng.random() * N, float(rng.integers(1, N + 1)), 0.5, N * (1 - 1e-13)):
            a = _scale_by_sweep(xs, prefix, first, n, 0.0)
            b = _scale_without_floor(xs, prefix, first, n, 0.0)
            assert np.float64(a).tobytes() == np.float64(b).tobytes(), (kind, N, n)


def test_branch_free_gather_keeps_the_reference_set_in_the_reference_order():
    rng = np.random.default_rng(5)
    P = 300
    for trial in range(400):
        pi = rng.random(P)
        pi[rng.random(P) < 0.2] = 1.0
        pi[rng.random(P) < 0.1] = 0.0
        if trial % 4 == 0:
            pi[:] = 1.0  # everything take-all
        tau = int(rng.integers(0, P + 1))
        u = rng.random(P)
        u[tau:] = 0.0 if trial % 2 else u[tau:]  # a fresh sample's zeros beyond the step
        ref_flag, ref_idx = np.empty(P, np.bool_), np.empty(P, np.int64)
        got_flag, got_idx = np.empty(P, np.bool_), np.empty(P, np.int64)
        ref = gather_kept(pi, u, np.zeros(P, np.uint8), False, tau, ref_flag, ref_idx)
        got = gather_by_rule(pi, u, tau, got_flag, got_idx)
        assert got[:3] == ref[:3]
        assert np.float64(got[3]).tobytes() == np.float64(ref[3]).tobytes()
        assert (got_flag == ref_flag).all()
        assert (got_idx[:ref[1]] == ref_idx[:ref[1]]).all()


def test_step_uniforms_with_a_hoisted_key_are_the_permanent_uniforms_of_the_step_stream():
    out = np.empty(40)
    step_uniforms_into(7, step_stream(33), 2, 1, 33, out)
    ref = permanent_uniforms(7, 2, 1, np.arange(33), stream=step_stream(33))
    assert out[:33].tobytes() == ref.tobytes()
    assert (out[33:] == 0.0).all()
