"""The compiled attention rows of a score's observation window against a loop reference.

Ground truth: one softmax per query written out in plain Python/numpy from the definition
(``docs/math.md``): logits ``scale q . k`` (soft-capped), visible positions ``[t - w + 1, t]``
(or ``[0, t]``), a learned sink in the normaliser only. The kernel's sums run in another order,
so the comparison is to 1e-12 relative, not bit for bit. The rows of several heads in one call
(:func:`head_rows`) are compared bit for bit between its serial and parallel paths and across
``NUMBA_NUM_THREADS`` in fresh interpreters.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.replay_fixtures import synthetic_trace
from tracesim.kernels import attention_rows as AR
from tracesim.kernels.attention import LogitRule
from tracesim.kernels.attention_rows import head_rows, softmax_rows

ROOT = Path(__file__).resolve().parents[1]


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


def _layer(seed=4, n_kv=3, G=3, P=70, d=64, n_query=9):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n_kv, P, d))
    queries = rng.standard_normal((n_kv * G, n_query, d))
    positions = np.sort(rng.choice(P, n_query, replace=False)).astype(np.int64)
    return keys, queries, positions


@pytest.mark.parametrize(("softcap", "window", "sinks"),
                         [(0.0, 0, False), (4.0, 0, False), (0.0, 9, True), (2.5, 6, True)])
def test_head_rows_match_the_loop_reference(softcap, window, sinks):
    keys, queries, positions = _layer()
    H, n_query = queries.shape[:2]
    G = H // keys.shape[0]
    sink = (np.linspace(-1.0, 2.0, H) if sinks else np.full(H, -np.inf))
    # every head with a few queries, out of order, a head repeated with other queries
    heads = np.array([4, 4, 0, 8, 2, 7, 7, 1], dtype=np.int64)
    qidx = np.array([0, 8, 3, 5, 1, 2, 6, 4], dtype=np.int64)
    out = np.zeros((heads.size, keys.shape[1]))
    head_rows(keys, queries, heads, qidx, positions, LogitRule(0.125, softcap, window), sink,
              out)
    for j, (h, i) in enumerate(zip(heads, qidx, strict=True)):
        ref = _reference_row(keys[h // G], queries[h, i], int(positions[i]), 0.125, softcap,
                             window, sink[h], keys.shape[1])
        np.testing.assert_allclose(out[j], ref, rtol=1e-12, atol=1e-15)


def test_head_rows_serial_and_parallel_paths_write_the_same_bytes():
    keys, queries, positions = _layer(P=300)
    H, n_query = queries.shape[:2]
    heads = np.repeat(np.arange(H, dtype=np.int64), n_query)
    qidx = np.tile(np.arange(n_query, dtype=np.int64), H)
    rule, sink = LogitRule(0.125, 0.0, 0), np.full(H, -np.inf)
    a = np.zeros((heads.size, keys.shape[1]))
    b = np.zeros_like(a)
    AR._head_rows_ser(keys, queries, heads, qidx, positions, rule, sink, a)
    AR._head_rows_par(keys, queries, heads, qidx, positions, rule, sink, b)
    assert a.tobytes() == b.tobytes()
    # and each row is the one the one-head kernel writes
    c = np.zeros((n_query, keys.shape[1]))
    softmax_rows(keys[1], queries[4], positions, rule, -np.inf, c)
    np.testing.assert_allclose(a[4 * n_query:5 * n_query], c, rtol=1e-12, atol=1e-15)


_ROWS_DIGEST = """
import hashlib, sys
import numpy as np
sys.path.insert(0, {root!r})
from tests.test_attention_rows import _layer
from tracesim.kernels import attention_rows as AR
from tracesim.kernels.attention import LogitRule
keys, queries, positions = _layer(P=300)
H, n = queries.shape[:2]
heads = np.repeat(np.arange(H, dtype=np.int64), n)
qidx = np.tile(np.arange(n, dtype=np.int64), H)
out = np.zeros((heads.size, keys.shape[1]))
AR._head_rows_par(keys, queries, heads, qidx, positions, LogitRule(0.125, 3.0, 40),
                  np.linspace(-1.0, 1.0, H), out)
print(hashlib.sha256(out.tobytes()).hexdigest())
"""


def test_head_rows_same_bytes_on_one_and_two_numba_threads_in_fresh_interpreters():
    digests = []
    for n in (1, 2):
        env = {**os.environ, "NUMBA_NUM_THREADS": str(n)}
        run = subprocess.run([sys.executable, "-c", _ROWS_DIGEST.format(root=str(ROOT))],
                             env=env, capture_output=True, text=True, timeout=900, check=False)
        assert run.returncode == 0, run.stderr[-2000:]
        digests.append(run.stdout.split()[-1])
    assert digests[0] == digests[1]


def test_attention_rows_are_the_same_whichever_call_computes_them():
    # a row computed alone (attention) and in a group's call (group_attention) is one value
    t1 = synthetic_trace(2, n_heads=6, n_kv=2, d=16, P=60, prompt_length=50)
    t2 = synthetic_trace(2, n_heads=6, n_kv=2, d=16, P=60, prompt_length=50)
    idx = t1.indices_before(50)[-4:]
    single = [t1.attention(h, int(i)).copy() for h in t1.group(1) for i in idx]
    t2.group_attention(1, idx)
    grouped = [t2.attention(h, int(i)) for h in t2.group(1) for i in idx]
    for a, b in zip(single, grouped, strict=True):
        assert a.tobytes() == b.tobytes()
    # negative indices name the same stored query; out-of-range ones are refused
    nq = t1.query_positions.size
    assert t1.attention(0, -1).tobytes() == t1.attention(0, nq - 1).tobytes()
    with pytest.raises(IndexError):
        t1.attention(0, nq)
    with pytest.raises(IndexError):
        t1.attention(t1.n_heads, 0)
