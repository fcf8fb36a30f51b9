"""Capture: record attention traces of Hugging Face causal LMs into a trace store.

Two rooms. The **recorder** (this package's top-level modules) runs a model and writes what its
attention saw; it depends only on :mod:`tracesim.store`. The **in-loop evaluator**
(:mod:`capture.inloop`) enforces tracesim's policies inside the model and records outcomes; it
sits downstream of :mod:`tracesim.policies` and :mod:`tracesim.tiers`, and nothing in the
recorder imports it.

Recorder modules (all but :mod:`capture.cli`, :mod:`capture.tasks` and
:mod:`capture.haystack` import torch):

- :mod:`capture.attention` -- the recording attention function and :class:`CaptureState`;
- :mod:`capture.generate` -- the explicit greedy generation loop (prefill, decode);
- :mod:`capture.models` -- SmolLM2 from its GGUF, local checkpoints, tiny test models, RoPE
  settings;
- :mod:`capture.tasks` -- generated long-context tasks with exact graders;
- :mod:`capture.haystack` -- the filler text and word lists the tasks draw from;
- :mod:`capture.prompts` -- user prompt files (JSON Lines) rendered and graded like the tasks;
- :mod:`capture.runner` -- capture runs into a :class:`tracesim.store.TraceWriter`;
- :mod:`capture.evaluate` -- full-cache task accuracy without recording;
- :mod:`capture.cli` -- the ``tracesim capture`` subcommand.

This package imports nothing heavy itself, so ``import capture.cli`` stays torch-free.
"""
