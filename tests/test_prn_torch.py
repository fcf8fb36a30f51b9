"""The torch port of the permanent random numbers is bit-identical to the numba kernel."""

import numpy as np
import pytest
import torch
from tracesim.capture.inloop.prn_torch import permanent_uniforms_torch

from tracesim.prn import STREAM_PERTURBATION, permanent_uniforms


@pytest.mark.parametrize(("seed", "layer", "head"), [(0, 0, 0), (99, 29, 2), (2**32 - 1, 3, 1)])
def test_bit_identical_to_numba(seed, layer, head):
    positions = np.r_[np.arange(5000), 2**31 + 7, 2**32 - 1]
    want = permanent_uniforms(seed, layer, head, positions)
    got = permanent_uniforms_torch(seed, layer, head, torch.from_numpy(positions))
    np.testing.assert_array_equal(got.numpy(), want)
    other = permanent_uniforms_torch(seed, layer, head, torch.from_numpy(positions),
                                     stream=STREAM_PERTURBATION)
    np.testing.assert_array_equal(
        other.numpy(), permanent_uniforms(seed, layer, head, positions, stream=STREAM_PERTURBATION))


def test_broadcast_over_heads_and_validation():
    pos = torch.arange(100).expand(3, 100)
    heads = torch.arange(3)[:, None]
    got = permanent_uniforms_torch(5, 1, heads, pos)
    for h in range(3):
        np.testing.assert_array_equal(got[h].numpy(), permanent_uniforms(5, 1, h, np.arange(100)))
    with pytest.raises(ValueError, match="seed"):
        permanent_uniforms_torch(-1, 0, 0, pos)
