"""The compiled attention rows of a score's observation window against a loop reference.

Ground truth: one softmax per query written out in plain Python/numpy from the definition
(``docs/math.md``): logits ``scale q . k`` (soft-capped), visible positions ``[t - w + 1, t]``
(or ``[0, t]``), a learned sink in the normaliser only. The kernel's sums run in another order,
so the comparison is to 1e-12 relative, not bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.replay_fixtures import synthetic_trace
from tracesim.kernels.attention import LogitRule
from tracesim.kernels.attention_rows import softmax_rows


def _reference_row(keys, q, t, scale, softcap, window, sink, P):
    lo = max(0, t - window + 1) if window else 0
    z = np.array([scale * float(np.dot(keys[i], q)) for i in range(lo, t + 1)])
    if softcap:
        z = softcap * np.tanh(z / softcap)
    top = max(z.max(), sink)
    w = np.exp(z - top)
    den = w.sum() + (np.exp(sink - top) if sink > -np.inf else 0.0)
    row = np.zeros(P)
    row[lo:t + 1] = w / den
    return row


@pytest.mark.parametrize(("softcap", "window", "sink"),
                         [(0.0, 0, -np.inf), (5.0, 0, -np.inf), (0.0, 7, -np.inf),
                          (0.0, 0, 1.5), (3.0, 5, -0.5)])
def test_softmax_rows_match_the_loop_reference(softcap, window, sink):
    rng = np.random.default_rng(3)
    P, d, n = 40, 64, 6
    keys = rng.standard_normal((P, d))
    queries = rng.standard_normal((n, d))
    pos = np.array([0, 3, 17, 25, 38, 39], dtype=np.int64)
    out = np.zeros((n, P))
    softmax_rows(keys, queries, pos, LogitRule(0.125, softcap, window), sink, out)
    for j in range(n):
        ref = _reference_row(keys, queries[j], int(pos[j]), 0.125, softcap, window, sink, P)
        np.testing.assert_allclose(out[j], ref, rtol=1e-12, atol=1e-15)
        assert np.all(out[j, pos[j] + 1:] == 0.0)
        total = out[j].sum()
        if sink == -np.inf:
            assert abs(total - 1.0) < 1e-12
        else:
            assert 0.0 < total < 1.0  # the sink takes the rest


def test_group_attention_is_the_mean_of_the_reference_rows():
    trace = synthetic_trace(2, n_heads=6, n_kv=2, d=16, P=60, prompt_length=50)
    idx = trace.indices_before(50)[-5:]
    for g in range(trace.n_kv_heads):
        got = trace.group_attention(g, idx)
        ref = np.zeros(trace.n_positions)
        for h in trace.group(g):
            for i in idx:
                ref += _reference_row(trace.keys[g], trace.queries[h, i],
                                      int(trace.query_positions[i]), trace.scale, 0.0, 0,
                                      -np.inf, trace.n_positions)
        ref /= len(trace.group(g)) * len(idx)
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-15)
        # a cached row is returned as it was computed, not recomputed
        assert trace.attention(trace.group(g)[0], int(idx[0])) is trace.attention(
            trace.group(g)[0], int(idx[0]))
