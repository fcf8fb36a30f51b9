"""Kept sets of one policy and seed at its first eviction event, for the in-loop path.

The in-loop (torch) path must keep exactly the tokens the simulator keeps; it therefore asks the
replay engine's own inclusion code rather than re-deriving anything.
"""

from __future__ import annotations

import numpy as np

from tracesim.policies import LayerTrace, Policy
from tracesim.replay.inclusion import fixed_kept, seed_uniforms, slot_events

__all__ = ["event_inclusion", "first_event_inclusion"]


def first_event_inclusion(
    trace: LayerTrace,
    policy: Policy,
    seed: int,
    n_layers: int,
    uniforms: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Inclusion probabilities and kept mask after the first (one-shot) event.

    Parameters
    ----------
    trace : LayerTrace
    policy : Policy
    seed : int
    n_layers : int
        Number of layers of the model (PyramidKV's schedule needs it).
    uniforms : ndarray, shape (n_kv_heads, n_positions), optional
        Permanent uniforms of stream 0 for this seed and layer (computed if omitted).

    Returns
    -------
    pi : ndarray of float64, shape (n_kv_heads, n_positions)
    kept : ndarray of bool, shape (n_kv_heads, n_positions)
        ``u < pi`` for Poisson designs (π ∈ {0, 1} for deterministic ones), the order sample for
        fixed-size designs.
    """
    qpos = np.array([trace.n_positions - 1], dtype=np.int64)
    pi_events, _, _ = slot_events(trace, policy, int(seed), n_layers, qpos)
    pi = np.ascontiguousarray(pi_events[0])
    if uniforms is None:
        uniforms = seed_uniforms(np.array([seed]), trace.layer, trace.n_kv_heads,
                                 trace.n_positions)[0]
    if policy.design is not None and policy.design.variance == "fixed":
        kept = fixed_kept(policy.design, pi, uniforms).astype(bool)
    else:
        kept = uniforms < pi
    return pi, kept


def event_inclusion(
    trace: LayerTrace,
    policy: Policy,
    seed: int,
    n_layers: int,
    tau: int,
    uniforms: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Effective inclusion probabilities and kept mask after the last event at or before ``tau``.

    ``trace`` holds what exists at time ``tau`` (positions ``< tau``, the decode queries so far);
    every event is recomputed from it, which equals the offline result because a score at an
    event only reads what precedes it. The probabilities are the running minimum over events
    (the nested permanent-random-number rule), so ``kept = u < pi`` stays a Poisson design.

    Returns
    -------
    pi, kept : ndarrays of shape (n_kv_heads, n_positions)
    """
    if policy.design is not None and policy.design.variance == "fixed":
        raise ValueError("fixed-size designs support only the one-shot schedule")
    pi_events, taus, _ = slot_events(trace, policy, int(seed), n_layers,
                                      np.array([int(tau)], dtype=np.int64))
    e = int(np.searchsorted(taus, int(tau), side="right") - 1)
    pi = np.ascontiguousarray(pi_events[max(e, 0)])
    if uniforms is None:
        uniforms = seed_uniforms(np.array([seed]), trace.layer, trace.n_kv_heads,
                                 trace.n_positions)[0]
    return pi, uniforms < pi
