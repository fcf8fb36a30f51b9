"""Synthetic trace stores with a documented generative model (``tracesim synth``).

:func:`write_synthetic_store` writes a store in the normal format (``docs/trace-format.md``),
so every command works on it; the model (attention sinks, a local window, heavy hitters and
retrieval heads with single-token spikes, SmolLM2-like or Llama-like shapes) is described in
``docs/synth.md``. Only numpy and pyarrow are needed.
"""

from __future__ import annotations

from .store import SHAPES, SynthConfig, write_synthetic_store

__all__ = ["SHAPES", "SynthConfig", "write_synthetic_store"]
