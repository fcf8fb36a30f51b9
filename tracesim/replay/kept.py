"""Kept sets of one policy and seed at its first eviction event, for the in-loop path.

The in-loop (torch) path must keep exactly the tokens the simulator keeps; it therefore asks the
replay engine's own inclusion code rather than re-deriving anything.
"""

from __future__ import annotations

import numpy as np

from tracesim.layer_trace import LayerTrace
from tracesim.policies import Policy
from tracesim.replay.inclusion import fixed_kept, fresh_uniforms, seed_uniforms, slot_events

__all__ = ["event_inclusion", "first_event_inclusion"]


def event_inclusion(
    trace: LayerTrace,
    policy: Policy,
    seed: int,
    n_layers: int,
    tau: int | None = None,
    uniforms: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Effective inclusion probabilities and kept mask after an eviction event.

    With ``tau = None`` the first event (one-shot compression after prefill); otherwise the last
    event at or before ``tau``. ``trace`` holds what exists at that time (positions ``< tau``,
    the decode queries so far); every event is recomputed from it, which equals the offline
    result because a score at an event only reads what precedes it. Probabilities are the
    running minimum over events (the nested permanent-random-number rule), so ``kept = u < pi``
    stays a Poisson design.

    Parameters
    ----------
    trace : LayerTrace
    policy : Policy
    seed : int
    n_layers : int
        Number of layers of the model (PyramidKV's schedule needs it).
    tau : int, optional
        Event time (see above).
    uniforms : ndarray, shape (n_kv_heads, n_positions), optional
        Permanent uniforms of stream 0 for this seed and layer (computed if omitted).

    Returns
    -------
    pi : ndarray of float64, shape (n_kv_heads, n_positions)
    kept : ndarray of bool, shape (n_kv_heads, n_positions)
        ``u < pi`` for Poisson designs (π ∈ {0, 1} for deterministic ones), the order sample for
        fixed-size designs (one-shot only).
    """
    fixed = policy.design is not None and policy.design.variance == "fixed"
    if fixed and tau is not None:
        raise ValueError("fixed-size designs support only the one-shot schedule")
    last = trace.n_positions - 1 if tau is None else int(tau)
    pi_events, taus, _ = slot_events(trace, policy, int(seed), n_layers,
                                     np.array([last], dtype=np.int64))
    e = 0 if tau is None else max(int(np.searchsorted(taus, last, side="right") - 1), 0)
    pi = np.ascontiguousarray(pi_events[e])
    if policy.schedule.fresh:  # the step's own uniforms, not stream 0
        uniforms = np.stack([fresh_uniforms(seed, trace.layer, g, trace.n_positions,
                                            int(taus[e])) for g in range(trace.n_kv_heads)])
    elif uniforms is None:
        uniforms = seed_uniforms(np.array([seed]), trace.layer, trace.n_kv_heads,
                                 trace.n_positions)[0]
    kept = fixed_kept(policy.design, pi, uniforms).astype(bool) if fixed else uniforms < pi
    return pi, kept


def first_event_inclusion(
    trace: LayerTrace,
    policy: Policy,
    seed: int,
    n_layers: int,
    uniforms: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`event_inclusion` at the first event (compression right after prefill)."""
    return event_inclusion(trace, policy, seed, n_layers, None, uniforms)
