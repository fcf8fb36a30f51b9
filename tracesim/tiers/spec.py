"""``tiers.yaml``: what ``tracesim tiers`` simulates (read with
:func:`tracesim.safeio.read_yaml`; nothing in it is executed or imported).

.. code-block:: yaml

    store: ../traces              # relative to this file (or --store on the command line)
    grid:                          # base eviction policies, the grammar of sweep grids;
      score: [snapkv]              # one-shot schedules only
      design: [poisson]
      budget: [0.25]
      design_params: {poisson: {mixture: 0.1}}
    seeds: 8                       # or a list
    layers: all                    # or [0, 10, 20]
    sequences: [id1, id2]          # optional
    schedulers: [none, random, confidence, certificate, bound, oracle]
    fetch_budgets: [0, 0.02, 0.05, 0.1, 0.25, 1.0]   # fractions of the evicted bytes per step
    memory:                        # see tracesim.tiers.model (defaults documented there)
      page: 16
      overlap: false
      hbm_bandwidth_gbps: 4800
      tiers:
        - {name: dram, bandwidth_gbps: 64, latency_us: 10, capacity_gb: 512, queue_depth: 8}
        - {name: nvme, bandwidth_gbps: 14, latency_us: 80, capacity_gb: 7680, queue_depth: 64}
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tracesim.counts import LAYER_INDEX, LAYERS, SEED_VALUE, SEQUENCES, TIERS_SEEDS, Count
from tracesim.policies import Policy
from tracesim.policies.grid import parse_grid
from tracesim.tiers.model import MemoryModel, TierError, memory_model_from_dict
from tracesim.tiers.schedulers import SCHEDULERS, scheduler_names, scheduler_source_hash

__all__ = ["MAX_SEEDS", "TiersSpec", "load_tiers_spec", "parse_tiers_spec"]

MAX_SEEDS = TIERS_SEEDS.hi  # in either spelling: an int n or a list of n distinct seeds
_KEYS = {"store", "grid", "seeds", "layers", "sequences", "schedulers", "fetch_budgets",
         "memory", "version", "name"}
_TIER_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")


@dataclass(frozen=True)
class TiersSpec:
    """A validated tiers spec."""

    store: str | None
    policies: tuple[Policy, ...]
    seeds: tuple[int, ...]
    layers: tuple[int, ...] | None
    sequences: tuple[str, ...] | None
    schedulers: tuple[str, ...]
    fetch_budgets: tuple[float, ...]
    memory: MemoryModel
    raw: dict[str, Any]

    @property
    def spec_hash(self) -> str:
        """sha256 of the canonical spec (what a resumed run must match); a registered scheduler
        adds the hash of its rules' source files, so editing one never mixes rows."""
        doc = {k: v for k, v in self.raw.items() if k not in ("store", "name")}
        doc["policies"] = [p.id for p in self.policies]
        doc["memory"] = self.memory.to_dict()
        registered = [s for s in self.schedulers if s not in SCHEDULERS]
        if registered:
            doc["scheduler_sources"] = {s: scheduler_source_hash(s) for s in registered}
        return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _int_list(value: Any, where: str, lo: int, hi: int, count: Count) -> tuple[int, ...]:
    if isinstance(value, bool) or not isinstance(value, list) or not value:
        raise TierError(f"{where}: expected a non-empty list of ints")
    count.check_items(value, where, TierError)  # length before the items are looked at
    out = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise TierError(f"{where}[{i}] = {v!r}: expected an int in [{lo}, {hi}]")
        out.append(v)
    if len(set(out)) != len(out):
        raise TierError(f"{where}: values must be distinct")
    return tuple(out)


def parse_tiers_spec(doc: Any, source: str = "<dict>") -> TiersSpec:
    """Validate a loaded tiers spec (errors name the field and the expected value)."""
    if not isinstance(doc, dict):
        raise TierError(f"{source}: expected a mapping at the top level")
    unknown = set(doc) - _KEYS
    if unknown:
        raise TierError(f"{source}: unknown field(s) {sorted(unknown)}; expected some of "
                        f"{sorted(_KEYS)}")
    if "grid" not in doc:
        raise TierError(f"{source}: field 'grid' (the base eviction policies) is required")
    try:
        policies = tuple(parse_grid(doc["grid"], f"{source}: grid"))
    except ValueError as exc:
        raise TierError(str(exc)) from None
    for p in policies:
        if not p.score.evicts or p.schedule.kind != "oneshot":
            raise TierError(f"{source}: grid: {p.id}: tiers needs evicting one-shot policies")
    seeds = doc.get("seeds", 8)
    if isinstance(seeds, bool) or not isinstance(seeds, (int, list)):
        raise TierError(f"{source}: seeds = {seeds!r}: expected an int or a list of ints")
    if isinstance(seeds, int):
        if not 1 <= seeds <= MAX_SEEDS:
            raise TierError(f"{source}: seeds = {seeds}: expected an int in [1, {MAX_SEEDS}]")
        seed_t = tuple(range(seeds))
    else:
        seed_t = _int_list(seeds, f"{source}: seeds", 0, SEED_VALUE.hi, TIERS_SEEDS)
    layers = doc.get("layers", "all")
    layer_t = None if layers == "all" else _int_list(layers, f"{source}: layers", 0,
                                                     LAYER_INDEX.hi, LAYERS)
    seqs = doc.get("sequences")
    if seqs is not None and (not isinstance(seqs, list) or not seqs):
        raise TierError(f"{source}: sequences: expected a non-empty list of sequence ids")
    if seqs is not None:
        SEQUENCES.check_items(seqs, f"{source}: sequences", TierError)
        if not all(isinstance(s, str) for s in seqs):
            raise TierError(f"{source}: sequences: expected a non-empty list of sequence ids")
    scheds = doc.get("schedulers", list(SCHEDULERS))
    if not isinstance(scheds, list) or not scheds:
        raise TierError(f"{source}: schedulers: expected a non-empty list")
    known = scheduler_names()
    bad = [s for s in scheds if s not in known]
    if bad:
        raise TierError(f"{source}: schedulers: unknown {bad}; expected some of "
                        f"{list(known)}")
    if "certificate" in scheds:
        uncertified = [p.id for p in policies if not p.certified]
        if uncertified:
            raise TierError(f"{source}: schedulers: 'certificate' needs certified base "
                            f"policies (randomized design, Hájek); not: {uncertified[:3]}")
    fb = doc.get("fetch_budgets", [0.0, 0.05, 0.1, 0.25, 1.0])
    if not isinstance(fb, list) or not fb or len(fb) > 1000:
        raise TierError(f"{source}: fetch_budgets: expected a non-empty list of at most 1000 "
                        "fractions")
    for i, f in enumerate(fb):
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
            raise TierError(f"{source}: fetch_budgets[{i}] = {f!r}: expected a fraction in "
                            "[0, 1] of the evicted bytes")
    memory = memory_model_from_dict(doc.get("memory"), f"{source}: memory")
    for t in memory.lower:
        if not _TIER_NAME.match(t.name):
            raise TierError(f"{source}: memory.tiers: name {t.name!r}: expected letters, "
                            "digits and _ (it names a column)")
    store = doc.get("store")
    if store is not None and not isinstance(store, str):
        raise TierError(f"{source}: store: expected a path string")
    return TiersSpec(store=store, policies=policies, seeds=seed_t, layers=layer_t,
                     sequences=None if seqs is None else tuple(seqs),
                     schedulers=tuple(dict.fromkeys(scheds)),
                     fetch_budgets=tuple(float(f) for f in fb), memory=memory, raw=dict(doc))


def load_tiers_spec(path: str | Path) -> TiersSpec:
    """Read and validate a tiers spec file; a relative ``store`` is resolved against it."""
    from tracesim.safeio import read_yaml

    path = Path(path)
    try:
        doc = read_yaml(path, "tiers spec", error=TierError)
    except OSError as exc:
        raise TierError(f"{path}: cannot read the spec ({exc.strerror}), expected a YAML "
                        "file") from None
    spec = parse_tiers_spec(doc, str(path))
    if spec.store is not None and not Path(spec.store).is_absolute():
        spec = TiersSpec(**{**spec.__dict__, "store": str((path.parent / spec.store).resolve())})
    return spec


def seeds_array(spec: TiersSpec) -> np.ndarray:
    """The spec's seeds as an int64 array."""
    return np.asarray(spec.seeds, dtype=np.int64)
