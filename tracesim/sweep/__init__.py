"""Declarative, resumable sweeps of replay configurations, locally or on Dask.

>>> from tracesim.sweep import run_sweep
>>> summary = run_sweep("data/sweeps/example.yaml", workers=2)      # doctest: +SKIP
>>> summary.n_rows, summary.results                                   # doctest: +SKIP

A sweep spec (YAML, ``yaml.safe_load`` only) names trace stores, a sequence filter, layers, a
grid of policies, seeds and what to record (:mod:`tracesim.sweep.spec`,
:mod:`tracesim.policies.grid`). The sweep is partitioned into tasks (one sequence × a chunk of
layers × a chunk of configurations, :mod:`tracesim.sweep.tasks`), each writing one Parquet file
atomically under a deterministic name; a local process pool or Dask runs them
(:mod:`tracesim.sweep.backends`); a rerun skips finished tasks; the last step publishes the
task files as the results dataset ``results/`` (parts, ``manifest.json``, ``summary.json``;
:mod:`tracesim.sweep.dataset`). See ``docs/sweeps.md``.
"""

from __future__ import annotations

from tracesim.policies.grid import GRID_KEYS, SpecError, expand_grid, parse_grid
from tracesim.sweep.dryrun import calibrate, describe
from tracesim.sweep.run import SweepSummary, run_sweep
from tracesim.sweep.spec import SPEC_KEYS, SweepSpec, load_spec, parse_spec
from tracesim.sweep.tasks import Task, TaskPlan, plan_tasks, sweep_schema

__all__ = [
    "GRID_KEYS", "SPEC_KEYS", "SpecError", "SweepSpec", "SweepSummary", "Task", "TaskPlan",
    "calibrate", "describe", "expand_grid", "load_spec", "parse_grid", "parse_spec",
    "plan_tasks", "run_sweep", "sweep_schema",
]
