"""Tiered KV memory: certificate-scheduled fetches of evicted pages from DRAM and NVMe.

Offline: :func:`simulate_layer` replays fetch schedulers over one layer of a trace store under
a :class:`MemoryModel` (bandwidths, latencies, capacities, page size, overlap);
:func:`run_tiers` runs a ``tiers.yaml`` spec over a store (``tracesim tiers``). See
``docs/tiers.md``. A new fetch scheduler is a :class:`Scheduler` added with
:func:`register_scheduler` (``docs/extending.md``).
"""

from tracesim.tiers.model import DEFAULT_TIERS, MemoryModel, Tier, TierError, load_memory_model
from tracesim.tiers.run import TIERS_COLUMNS, run_tiers, tiers_schema
from tracesim.tiers.schedulers import (
    DEPLOYABLE,
    SCHEDULERS,
    PageInputs,
    Scheduler,
    register_scheduler,
)
from tracesim.tiers.simulate import simulate_layer
from tracesim.tiers.spec import TiersSpec, load_tiers_spec, parse_tiers_spec

__all__ = ["DEFAULT_TIERS", "DEPLOYABLE", "SCHEDULERS", "TIERS_COLUMNS", "MemoryModel",
           "PageInputs", "Scheduler", "Tier", "TierError", "TiersSpec", "load_memory_model",
           "load_tiers_spec", "parse_tiers_spec", "register_scheduler", "run_tiers",
           "simulate_layer", "tiers_schema"]
