"""Capture: record attention traces of Hugging Face causal LMs into a trace store.

Submodules (all but :mod:`capture.cli` and :mod:`capture.tasks` import torch):

- :mod:`capture.attention` -- the recording attention function and :class:`CaptureState`;
- :mod:`capture.generate` -- the explicit greedy generation loop;
- :mod:`capture.models` -- SmolLM2 from its GGUF, local checkpoints, tiny test models;
- :mod:`capture.tasks` -- generated long-context tasks with exact graders;
- :mod:`capture.runner` -- capture runs into a :class:`tracesim.store.TraceWriter`;
- :mod:`capture.cli` -- the ``tracesim capture`` subcommand.

This package imports nothing heavy itself, so ``import capture.cli`` stays torch-free.
"""
