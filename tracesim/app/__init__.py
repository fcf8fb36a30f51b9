"""The face of tracesim: the ``tracesim`` command line, the demo, the calibration study and the
generated command reference.

This is the top floor. It is the only part of ``tracesim`` (besides ``tracesim.capture`` and
``tracesim.analysis`` themselves) that may import ``tracesim.capture`` or ``tracesim.analysis``;
the import rules are in ``docs/extending.md`` and ``tests/test_import_rules.py`` enforces them.
"""
