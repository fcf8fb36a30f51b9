"""The per-step replay's fused value products, and its results on any thread or worker count.

Ground truth: numpy products of the gathered kept values (the GEMMs the fused loop replaces),
the plain-numpy reference replay (``tests/replay_reference.py``) at ``d = 64``, where the
kernel's loops have a compile-time head dimension, and byte comparisons across
``NUMBA_NUM_THREADS`` (fresh interpreters) and sweep worker counts.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.replay_fixtures import synthetic_trace
from tests.replay_reference import reference_replay
from tracesim.kernels import replay as K
from tracesim.kernels.replay_fused import fused_products
from tracesim.policies import make_policy
from tracesim.replay import ReplayOptions, replay_layer

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("d", [64, 128, 5])
@pytest.mark.parametrize(("n_cert", "n_cross"), [(3, 0), (0, 0), (3, 4), (2, 1)])
def test_fused_products_equal_the_gathered_gemms(d, n_cert, n_cross):
    rng = np.random.default_rng(d + 10 * n_cert + n_cross)
    P, m, mt = 50, 20, 14
    Vg = rng.standard_normal((P, d))
    kept = np.sort(rng.choice(P, m, replace=False)).astype(np.int64)
    We, Wd, Wxf = (rng.random((n, mt if i else m)) for i, n in enumerate((3, n_cert, n_cross)))
    X, TD, XF = fused_products(Vg, kept, m, mt, We, Wd, Wxf)
    Vk = Vg[kept]
    np.testing.assert_allclose(X, We @ Vk, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(TD, Wd @ np.hstack([Vk[:mt], Vk[:mt] ** 2]), rtol=1e-13,
                               atol=1e-13)
    np.testing.assert_allclose(XF, Wxf @ Vk[:mt], rtol=1e-13, atol=1e-13)
    assert TD.shape == (n_cert, 2 * d) and XF.shape == (n_cross, d)


def _policies():
    sp = {"window": 8}
    return [
        make_policy("perstep", "poisson", 0.3, schedule="step", design_params={"mixture": 0.1},
                    score_params={**sp, "proxy": "quant:4"}),
        make_policy("perstep", "poisson", 0.3, schedule="step:permanent",
                    score_params={**sp, "proxy": "exact", "gqa": "max"}),
        make_policy("perstep", "topk", 0.3, schedule="step", score_params={**sp,
                                                                          "proxy": "exact"}),
        make_policy("knorm", "fixed", 0.3, score_params=sp),
        make_policy("streaming", "poisson", 0.3, schedule="decode:4"),
        make_policy("snapkv", "poisson", 0.3, score_params=sp),
    ]


def test_fused_path_at_head_dim_64_matches_the_numpy_reference():
    # d = 64 takes the compile-time loops; satterthwaite off, so the per-step units (one query
    # x 3 heads) take the fused path and the one-shot events the BLAS one.
    trace = synthetic_trace(5, n_heads=6, n_kv=2, d=64, P=96, prompt_length=80)
    policies, seeds = _policies(), np.array([0, 1, 2])
    res = replay_layer(trace, policies, seeds, n_layers=4, options=ReplayOptions())
    ref, lref = reference_replay(trace, policies, seeds, res.tables)
    for f in range(K.N_FIELDS):
        if f == K.F_TRV2:
            continue  # off here (the reference always computes it)
        a, b = res.out[..., f], ref[..., f]
        assert np.array_equal(np.isnan(a), np.isnan(b)), f"NaN pattern of field {f}"
        ok = ~np.isnan(a)
        np.testing.assert_allclose(a[ok], b[ok], rtol=1e-10, atol=1e-12, err_msg=f"field {f}")
    ok = ~np.isnan(lref)
    assert np.array_equal(np.isnan(res.lout), ~ok)
    np.testing.assert_allclose(res.lout[ok], lref[ok], rtol=1e-10, atol=1e-12)


_DIGEST = """
import hashlib, sys
import numpy as np
sys.path.insert(0, {root!r})
from tests.replay_fixtures import synthetic_trace
from tests.test_replay_fused import _policies
from tracesim.replay import ReplayOptions, replay_layer
trace = synthetic_trace(5, n_heads=6, n_kv=2, d=64, P=96, prompt_length=80)
res = replay_layer(trace, _policies(), np.arange(4), n_layers=4, options=ReplayOptions())
print(hashlib.sha256(res.out.tobytes() + res.lout.tobytes()).hexdigest())
"""


def test_same_bytes_on_one_and_two_numba_threads_in_fresh_interpreters():
    digests = []
    for n in (1, 2):
        env = {**os.environ, "NUMBA_NUM_THREADS": str(n)}
        run = subprocess.run([sys.executable, "-c", _DIGEST.format(root=str(ROOT))], env=env,
                             capture_output=True, text=True, timeout=900, check=False)
        assert run.returncode == 0, run.stderr[-2000:]
        digests.append(run.stdout.split()[-1])
    trace = synthetic_trace(5, n_heads=6, n_kv=2, d=64, P=96, prompt_length=80)
    here = replay_layer(trace, _policies(), np.arange(4), n_layers=4, options=ReplayOptions())
    assert digests[0] == digests[1] == hashlib.sha256(here.out.tobytes()
                                                      + here.lout.tobytes()).hexdigest()


_PERSTEP_SPEC = """\
name: perstep
store: store
layers: all
grid:
  score: [perstep]
  design: [poisson]
  budget: [0.3]
  schedule: [step]
  score_params:
    perstep: {window: 6, proxy: "quant:4"}
seeds: 3
output: out
"""


def test_per_step_sweep_gives_the_same_rows_on_one_and_two_workers(tmp_path):
    import pyarrow.parquet as pq

    from tests.sweep_fixtures import build_sweep_store
    from tracesim.sweep import run_sweep

    build_sweep_store(tmp_path / "store", n_seqs=2, n_layers=2, d=64)
    (tmp_path / "spec.yaml").write_text(_PERSTEP_SPEC)
    keys = ["sequence_id", "layer", "config_id", "head", "query_index", "seed"]
    tables = []
    for workers in (1, 2):
        summary = run_sweep(tmp_path / "spec.yaml", workers=workers, threads_per_worker=1,
                            out=tmp_path / f"w{workers}", progress=False)
        assert summary.complete and summary.workers == workers
        df = pq.read_table(tmp_path / f"w{workers}" / "results" / "parts").to_pandas()
        tables.append(df.sort_values(keys).reset_index(drop=True))
    assert len(tables[0]) > 0
    import pandas as pd

    pd.testing.assert_frame_equal(tables[0], tables[1], check_exact=True)
