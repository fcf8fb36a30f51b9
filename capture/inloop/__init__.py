"""The in-loop evaluator: tracesim's policies enforced inside the model, outcomes recorded.

Downstream of :mod:`tracesim.policies` (kept sets), :mod:`tracesim.replay` (the same inclusion
code and permanent random numbers) and :mod:`tracesim.tiers` (the memory model); upstream only of
:mod:`analysis`. The recorder in :mod:`capture` never imports this package.

- :mod:`tracesim.capture.inloop.evict` -- prefill once, then decode every configuration from that
cache;
- :mod:`tracesim.capture.inloop.evict_run` -- run a grid in the loop: resume, outcomes;
- :mod:`tracesim.capture.inloop.evict_cli` -- the ``tracesim evict`` subcommand (arguments checked
first);
- :mod:`tracesim.capture.inloop.enforce` -- kept sets as an attention bias, the Hájek offset,
serving
  certificates;
- :mod:`tracesim.capture.inloop.onepass` -- one-pass attention with the certificate's quadratic
forms;
- :mod:`tracesim.capture.inloop.fetch` -- decode with a lower tier: pages fetched per step,
modelled time;
- :mod:`tracesim.capture.inloop.prn_torch` -- a bit-exact torch port of :mod:`tracesim.prn`.
- :mod:`tracesim.capture.inloop.answer` -- the answer span of a prompt, the share of it a run kept.

Importing this package imports nothing heavy; its modules (but the top levels of ``evict_run``
and ``evict_cli``, and ``answer``) import torch.
"""
