"""Capture: record attention traces of Hugging Face causal LMs into a trace store.

Two rooms. The **recorder** (this package's top-level modules) runs a model and writes what its
attention saw; it depends only on :mod:`tracesim.store`. The **in-loop evaluator**
(:mod:`tracesim.capture.inloop`) enforces tracesim's policies inside the model and records
outcomes; it
sits downstream of :mod:`tracesim.policies` and :mod:`tracesim.tiers`, and nothing in the
recorder imports it.

Recorder modules (all but :mod:`tracesim.capture.cli`, :mod:`tracesim.capture.tasks` and
:mod:`tracesim.capture.haystack` import torch):

- :mod:`tracesim.capture.attention` -- the recording attention function and :class:`CaptureState`;
- :mod:`tracesim.capture.generate` -- the explicit greedy generation loop (prefill, decode);
- :mod:`tracesim.capture.models` -- SmolLM2 from its GGUF, local checkpoints, tiny test models, RoPE
  settings;
- :mod:`tracesim.capture.tasks` -- generated long-context tasks with exact graders;
- :mod:`tracesim.capture.haystack` -- the filler text and word lists the tasks draw from;
- :mod:`tracesim.capture.prompts` -- user prompt files (JSON Lines) rendered and graded like the
tasks;
- :mod:`tracesim.capture.runner` -- capture runs into a :class:`tracesim.store.TraceWriter`;
- :mod:`tracesim.capture.evaluate` -- full-cache task accuracy without recording;
- :mod:`tracesim.capture.cli` -- the ``tracesim capture`` subcommand.

This package imports nothing heavy itself, so ``import tracesim.capture.cli`` stays torch-free.
"""
