"""The per-step unit's products four tokens at a time, against the gathered numpy GEMMs."""

from __future__ import annotations

import numpy as np
import pytest

from tracesim.kernels.fused_tiles import tiled_estimate, tiled_products
from tracesim.kernels.replay_fused import fused_products


@pytest.mark.parametrize("d", [64, 128, 5])
@pytest.mark.parametrize("m", [0, 1, 4, 13, 22])
def test_tiled_products_equal_the_gathered_gemms(d, m):
    # m runs through every remainder of the blocks of four (13 = 3 blocks + 1, 22 = 5 + 2).
    rng = np.random.default_rng(7 * d + m)
    P = 40
    Vg = rng.standard_normal((P, d))
    kept = np.sort(rng.choice(P, m, replace=False)).astype(np.int64)
    We, Wd, Wxf = rng.random((3, m)), rng.random((3, m)), rng.random((2, m))
    Vk = Vg[kept]
    X, TD = tiled_products(Vg, kept, m, We, Wd)
    np.testing.assert_allclose(X, We @ Vk, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(TD, Wd @ np.hstack([Vk, Vk ** 2]), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(tiled_estimate(Vg, kept, m, Wxf), Wxf @ Vk, rtol=1e-13,
                               atol=1e-13)
    # A unit whose kept tokens are all tail tokens takes this path through fused_products.
    X2, TD2, XF2 = fused_products(Vg, kept, m, m, We, Wd, Wxf)
    assert np.array_equal(X2, X) and np.array_equal(TD2, TD)
    np.testing.assert_allclose(XF2, Wxf @ Vk, rtol=1e-13, atol=1e-13)


def test_tiled_products_read_only_the_first_m_tokens():
    rng = np.random.default_rng(3)
    Vg = rng.standard_normal((30, 64))
    kept = np.arange(0, 30, 2, dtype=np.int64)
    We, Wd = rng.random((3, kept.size)), rng.random((3, kept.size))
    X, TD = tiled_products(Vg, kept, 9, We, Wd)
    Vk = Vg[kept[:9]]
    np.testing.assert_allclose(X, We[:, :9] @ Vk, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(TD[:, 64:], Wd[:, :9] @ Vk ** 2, rtol=1e-13, atol=1e-13)
