"""Torch port of :mod:`tracesim.prn`, bit for bit, for enforcing eviction inside the model.

torch has no full unsigned 64-bit arithmetic, so every 32-bit product is formed without
overflow in signed int64 as documented in :mod:`tracesim.prn`. The final uniform is built in
float64 exactly as the numba version does, so a configuration and seed keep the same tokens in
the simulator and in the model.
"""

from __future__ import annotations

import numpy as np
import torch

from tracesim.prn import STREAM_INCLUSION

__all__ = ["layer_uniforms_torch", "permanent_uniforms_torch"]

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def permanent_uniforms_torch(
    seed: int,
    layer: int,
    kv_head: int | torch.Tensor,
    positions: torch.Tensor,
    *,
    stream: int = STREAM_INCLUSION,
) -> torch.Tensor:
    """Permanent uniforms ``u(seed, layer, kv_head, position)`` as a float64 tensor.

    Parameters
    ----------
    seed, layer : int
        In ``[0, 2**32)``.
    kv_head : int or LongTensor broadcastable against ``positions``
    positions : LongTensor, any shape
        Absolute token positions in ``[0, 2**32)``.
    stream : int
        As in :func:`tracesim.prn.permanent_uniforms`.

    Returns
    -------
    torch.Tensor of float64, shape of ``positions`` broadcast with ``kv_head``, on its device;
    identical to :func:`tracesim.prn.permanent_uniforms`.
    """
    for name, value in (("seed", seed), ("layer", layer), ("stream", stream)):
        if not 0 <= int(value) < 2**32:
            raise ValueError(f"{name} must be an integer in [0, 2**32), got {value}")
    pos = positions.to(torch.int64)
    head = torch.as_tensor(kv_head, dtype=torch.int64, device=pos.device)
    h = _mix32(torch.full_like(pos, int(seed) ^ 0x243F6A88))
    h = _mix32(h ^ (int(stream) ^ 0x85A308D3))
    h = _mix32(h ^ (int(layer) ^ 0x13198A2E))
    h = _mix32(h ^ (head ^ 0x03707344))
    h = _mix32(h ^ (pos ^ 0xA4093822))
    g = _mix32(h ^ 0x299F31D0)
    hi = (h >> 6).to(torch.float64)
    lo = (g >> 6).to(torch.float64)
    return (hi * 2.0**26 + lo + 0.5) / 2.0**52


def layer_uniforms_torch(seed: int, layer: int, n_kv_heads: int, n_positions: int) -> np.ndarray:
    """Stream-0 uniforms of one layer, shape ``(n_kv_heads, n_positions)`` (float64 numpy),
    computed by the torch port, so the in-loop kept sets are those a serving system computes on
    its own device (equal to :func:`tracesim.replay.inclusion.seed_uniforms` for that seed)."""
    pos = torch.arange(n_positions)
    heads = torch.arange(n_kv_heads)[:, None]
    return permanent_uniforms_torch(int(seed), int(layer), heads,
                                    pos.expand(n_kv_heads, -1)).numpy()
