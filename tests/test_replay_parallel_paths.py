"""The layer kernels' parallel paths change no result; the exp-logits are the loop's bits.

Ground truth: the same replay on the serial paths (the thresholds of
:mod:`tracesim.kernels.replay_events` and :mod:`tracesim.kernels.attention_rows` forced to 0
send every kernel down its parallel path), byte for byte, on 1 and 2 numba threads in fresh
interpreters; and the exp-logits written as the definition's loop, one position and one
product at a time in plain Python (float64: the same bits, each sum taken in the same order).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tracesim.kernels import replay_events as RE
from tracesim.policies import make_policy

ROOT = Path(__file__).resolve().parents[1]

_DIGEST = """
import hashlib, sys
import numpy as np
sys.path.insert(0, {root!r})
import tracesim.kernels.attention_rows as AR
import tracesim.kernels.replay_events as RE
from tests.replay_fixtures import synthetic_trace
from tests.test_replay_parallel_paths import _policies
from tracesim.replay import ReplayOptions, replay_layer
if {parallel}:
    AR.SERIAL_BELOW = RE.SERIAL_BELOW = 0
trace = synthetic_trace(7, n_heads=6, n_kv=2, d=64, P=160, prompt_length=140)
res = replay_layer(trace, _policies(), np.arange(5), n_layers=4, options=ReplayOptions())
print(hashlib.sha256(res.out.tobytes() + res.lout.tobytes()).hexdigest())
"""


def _policies():
    sp = {"window": 8}
    return [make_policy("snapkv", "poisson", 0.25, correction="hajek", score_params=sp),
            make_policy("snapkv", "topk", 0.25, score_params=sp),
            make_policy("tova", "poisson", 0.3, correction="hajek")]


def _digest(threads: int, parallel: bool) -> str:
    env = {**os.environ, "NUMBA_NUM_THREADS": str(threads)}
    run = subprocess.run([sys.executable, "-c", _DIGEST.format(root=str(ROOT),
                                                               parallel=parallel)],
                         env=env, capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.split()[-1]


def test_parallel_paths_give_the_serial_bytes_on_one_and_two_threads():
    serial = _digest(2, False)
    assert _digest(1, True) == serial
    assert _digest(2, True) == serial


def _loop_exp_logits(Q, K, qpos, scale, G):
    H, NQ, d = Q.shape
    P = K.shape[1]
    E = np.zeros((H, NQ, P))
    for h in range(H):
        for q in range(NQ):
            n = min(int(qpos[q]) + 1, P)
            s = []
            for p in range(n):
                acc = 0.0
                for k in range(d):
                    acc += float(Q[h, q, k]) * float(K[h // G, p, k])
                s.append(acc * scale)
            top = max(s) if s else 0.0
            for p in range(n):
                # libm's exp, as compiled code calls it (numpy's own SIMD exp, used on
                # AVX-512 machines, can differ in the last bit)
                E[h, q, p] = math.exp(s[p] - top)
    return E


@pytest.mark.parametrize("parallel", [False, True])
def test_exp_logits_are_the_loops_bits(parallel, monkeypatch):
    if parallel:
        monkeypatch.setattr(RE, "SERIAL_BELOW", 0)
    rng = np.random.default_rng(11)
    Q, K = rng.standard_normal((6, 4, 16)), rng.standard_normal((2, 40, 16))
    qpos = np.array([0, 9, 38, 39], dtype=np.int64)
    E = np.full((6, 4, 40), np.nan)
    RE.exp_logits_kernel(Q, K, qpos, 0.25, 3, E)
    assert E.tobytes() == _loop_exp_logits(Q, K, qpos, 0.25, 3).tobytes()


def test_exp_logits_float32_sum_in_float64():
    rng = np.random.default_rng(12)
    Q = rng.standard_normal((4, 3, 32)).astype(np.float32)
    K = rng.standard_normal((2, 50, 32)).astype(np.float32)
    qpos = np.array([5, 30, 49], dtype=np.int64)
    E = np.empty((4, 3, 50), dtype=np.float32)
    RE.exp_logits_kernel(Q, K, qpos, 0.2, 2, E)
    ref = _loop_exp_logits(Q, K, qpos, 0.2, 2)  # products rounded differently: to rounding
    np.testing.assert_allclose(E, ref, rtol=2e-6, atol=1e-7)


def test_bootstrap_and_bound_kernels_same_bytes_on_one_and_two_threads():
    # Their parallel loops allocate work arrays in the loop body (numba may hoist such an
    # allocation out of a parallel loop): the outputs must not depend on the thread count.
    import numba

    from tests.replay_fixtures import synthetic_trace
    from tracesim.replay import ReplayOptions, replay_layer

    trace = synthetic_trace(3)
    pols = [make_policy("snapkv", "poisson", 0.3, score_params={"window": 8}, summary_page=8),
            make_policy("h2o", "topk", 0.4, score_params={"window": 8}, summary_page=4),
            make_policy("tova", "poisson", 0.3, correction="hajek")]
    runs = []
    before = numba.get_num_threads()
    try:
        for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(threads)
            runs.append(replay_layer(trace, pols, np.arange(6), n_layers=2,
                                     options=ReplayOptions(bootstrap=50)))
    finally:
        numba.set_num_threads(before)
    one, two = runs
    assert np.isfinite(one.boot).any() and np.isfinite(one.bounds).any()
    for name in ("out", "lout", "boot", "bounds"):
        assert getattr(one, name).tobytes() == getattr(two, name).tobytes(), name
