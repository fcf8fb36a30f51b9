"""The replay's exp-logits for the attention variants of current models: sliding windows,
soft-capped logits and learned sinks (``docs/math.md``, "Sliding windows, soft-capped logits and
learned sinks"). Plain layers keep the compiled :func:`tracesim.kernels.replay_events.
exp_logits_kernel`, so stores without these fields replay bit for bit as before."""

from __future__ import annotations

import numpy as np

from tracesim.layer_trace import LayerTrace

__all__ = ["variant_exp_logits"]


def variant_exp_logits(trace: LayerTrace, Q: np.ndarray, qpos: np.ndarray, E: np.ndarray,
                       zsink: np.ndarray) -> None:
    """``E`` and the sink shares of a sliding, soft-capped or sink layer (float64 maths).

    ``E[h, q, p] = exp(s - top)`` for ``p`` in the query's window ``(t - w, t]`` (every
    ``p <= t`` on a full layer), else 0, with ``s`` the soft-capped logit; ``top`` is the largest
    of those logits and the head's sink logit, and ``zsink[h, q] = exp(sink_h - top)`` (0 when
    the layer has no sinks). ``Q`` (H, NQ, d), ``qpos`` (NQ,).
    """
    H, P = Q.shape[0], trace.n_positions
    G = trace.group_size
    p = np.arange(P)
    hidden = p[None, :] > qpos[:, None]
    if trace.window is not None:
        hidden |= p[None, :] <= (qpos - trace.window)[:, None]
    for h in range(H):
        s = trace.logits(np.asarray(Q[h], dtype=np.float64) @ trace.keys[h // G].T)
        s[hidden] = -np.inf
        top = s.max(axis=1)
        if trace.sinks is not None:
            top = np.maximum(top, trace.sinks[h])
            zsink[h] = np.exp(trace.sinks[h] - top)
        E[h] = np.exp(s - top[:, None])
