"""The output space's compiled pieces against loop references: the layer error, one GEMM per
iteration (so a policy's layer error does not depend on what else is replayed), and the
per-token quadratic forms.

Ground truth: ``|W_O e|^2`` by a plain product with ``o_proj`` (not its triangular factor) and
``v^T Gamma v`` by a loop over positions; the replay's layer error against the float64
reference replay is in ``tests/test_replay_engine.py`` and ``tests/test_replay_fused.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.replay_fixtures import synthetic_trace
from tracesim.kernels import replay as K
from tracesim.kernels.replay_output_space import layer_error
from tracesim.policies import make_policy
from tracesim.replay import ReplayOptions, replay_layer
from tracesim.replay.output_space import gram_blocks, token_quadratic_forms


@pytest.mark.parametrize(("hidden", "n_heads", "d"), [(96, 6, 16), (40, 6, 16), (576, 9, 64)])
@pytest.mark.parametrize("cols", [1, 7, 130])
def test_layer_error_equals_the_product_with_o_proj(hidden, n_heads, d, cols):
    rng = np.random.default_rng(hidden + cols)
    W = rng.standard_normal((hidden, n_heads * d)) / np.sqrt(d)
    gram = gram_blocks(W, n_heads // 3, 3, d)
    errT = rng.standard_normal((n_heads * d, cols))
    errT[:, 0] *= 1e-9  # a small error: the direct form has no cancellation
    lerr = np.empty(cols)
    layer_error(errT, gram.rpack, gram.roff, gram.rstart, lerr)
    ref = np.array([np.dot(W @ errT[:, j], W @ errT[:, j]) for j in range(cols)])
    np.testing.assert_allclose(lerr, ref, rtol=1e-12, atol=0)
    zero = np.zeros((n_heads * d, 2))
    layer_error(zero, gram.rpack, gram.roff, gram.rstart, lerr[:2])
    assert (lerr[:2] == 0.0).all()


def test_quadratic_forms_equal_the_loop_reference():
    rng = np.random.default_rng(3)
    n_kv, G, d, P = 2, 3, 16, 300  # P over one chunk of positions
    W = rng.standard_normal((64, n_kv * G * d))
    gram = gram_blocks(W, n_kv, G, d)
    V = rng.standard_normal((n_kv, P, d))
    vq = token_quadratic_forms(V, gram.gam)
    ref = np.array([[[V[g, p] @ gram.gam[g, i] @ V[g, p] for p in range(P)]
                     for i in range(gram.gam.shape[1])] for g in range(n_kv)])
    np.testing.assert_allclose(vq, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())



def test_quadratic_forms_same_bytes_on_one_and_two_threads():
    # the (group, chunk) jobs run in parallel; each writes only its own slice
    import numba

    rng = np.random.default_rng(4)
    n_kv, G, d, P = 3, 3, 16, 700  # three chunks of positions, the last one short
    gram = gram_blocks(rng.standard_normal((96, n_kv * G * d)), n_kv, G, d)
    V = rng.standard_normal((n_kv, P, d))
    before = numba.get_num_threads()
    try:
        runs = []
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(threads)
            runs.append(token_quadratic_forms(V, gram.gam).tobytes())
    finally:
        numba.set_num_threads(before)
    assert len(set(runs)) == 1

def test_layer_error_does_not_depend_on_the_other_iterations():
    # 1 seed against 12, and each policy alone: the same (policy, seed 0) iterations among
    # others or none. The same bits: each iteration's layer error is a GEMM of its own (BLAS
    # may round a column of a shared product by its place in it).
    trace = synthetic_trace(8)
    pols = [make_policy("snapkv", "poisson", 0.3, score_params={"window": 8}),
            make_policy("h2o", "bernoulli", 0.4, score_params={"window": 8})]
    one = replay_layer(trace, pols, np.array([0]), n_layers=2, options=ReplayOptions())
    many = replay_layer(trace, pols, np.arange(12), n_layers=2, options=ReplayOptions())
    for c in range(len(pols)):
        alone = replay_layer(trace, [pols[c]], np.array([0]), n_layers=2,
                             options=ReplayOptions())
        i = np.flatnonzero((one.tables.it_cfg == c) & (one.tables.it_seed == 0))
        j = np.flatnonzero((many.tables.it_cfg == c) & (many.tables.it_seed == 0))
        assert many.lout[j].tobytes() == one.lout[i].tobytes() == alone.lout.tobytes()
        assert np.isfinite(many.lout[j][..., K.L_ERR2]).all()
