"""The tiered memory model: tiers, their bandwidths and latencies, and the modelled fetch time.

Tokens a policy keeps live in HBM. Every other prompt token lives, in pages of ``page``
consecutive positions per (layer, KV head), in a lower tier: host DRAM first (up to its
capacity), then NVMe. A *fetch* brings one page (the evicted tokens of one page of one KV
head: their keys and values) back into HBM for the current decode step.

Modelled time of the fetches of one (decode step, layer): each lower tier moves its pages over
its own link, so the tiers work in parallel and the slowest sets the time::

    t_tier  = ceil(n_fetches / queue_depth) * latency + bytes / bandwidth
    t_fetch = max over tiers of t_tier

and the *stall* is ``t_fetch`` without overlap, or ``max(0, t_fetch - t_compute)`` with
``overlap: true`` (fetches for a layer are issued while the previous layer computes; the
compute time of a layer is taken as the time to read its kept KV cache from HBM, since decode
attention is memory-bound).

Default figures (orders of magnitude; every one is configurable in ``tiers.yaml``):

* HBM: 4.8 TB/s — the HBM3e bandwidth NVIDIA lists for the H200.
* DRAM over the host link: 64 GB/s, 10 µs per transfer, queue depth 8 — PCIe 5.0 x16 carries
  32 GT/s per lane with 128b/130b encoding, about 63 GB/s per direction raw; the latency is the
  order of a DMA/copy launch.
* NVMe: 14 GB/s, 80 µs per read, queue depth 64 — the sequential read rate of current PCIe 5.0
  data-centre drives is 12–14 GB/s, and a random read takes tens of microseconds to complete.

The sources and the sensitivity to these numbers are discussed in ``docs/tiers.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["DEFAULT_TIERS", "TierError", "Tier", "MemoryModel", "load_memory_model",
           "memory_model_from_dict"]


class TierError(ValueError):
    """A tier parameter or ``tiers.yaml`` field is invalid (the message names the field)."""


@dataclass(frozen=True)
class Tier:
    """One memory tier.

    Parameters
    ----------
    name : str
    bandwidth_gbps : float
        Sustained read bandwidth into HBM, GB/s (1e9 bytes per second); > 0.
    latency_us : float
        Fixed cost of one fetch, microseconds; >= 0.
    capacity_gb : float
        Capacity for evicted pages, GB (1e9 bytes); > 0, ``inf`` allowed.
    queue_depth : int
        Fetches in flight at once (their latencies overlap); >= 1.
    """

    name: str
    bandwidth_gbps: float
    latency_us: float = 0.0
    capacity_gb: float = math.inf
    queue_depth: int = 1

    def __post_init__(self) -> None:
        where = f"tiers.{self.name}"
        for f in ("bandwidth_gbps", "latency_us", "capacity_gb"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise TierError(f"{where}.{f} = {v!r}: expected a number")
        if not (self.bandwidth_gbps > 0 and math.isfinite(self.bandwidth_gbps)):
            raise TierError(f"{where}.bandwidth_gbps = {self.bandwidth_gbps}: expected a finite "
                            "value > 0")
        if not (self.latency_us >= 0 and math.isfinite(self.latency_us)):
            raise TierError(f"{where}.latency_us = {self.latency_us}: expected a finite value "
                            ">= 0")
        if not self.capacity_gb > 0:
            raise TierError(f"{where}.capacity_gb = {self.capacity_gb}: expected a value > 0")
        if isinstance(self.queue_depth, bool) or not isinstance(self.queue_depth, int) \
                or self.queue_depth < 1:
            raise TierError(f"{where}.queue_depth = {self.queue_depth!r}: expected an int >= 1")

    def fetch_seconds(self, n_fetches: np.ndarray, n_bytes: np.ndarray) -> np.ndarray:
        """Modelled time of ``n_fetches`` fetches moving ``n_bytes`` bytes (elementwise)."""
        n_fetches = np.asarray(n_fetches, dtype=np.float64)
        waves = np.ceil(n_fetches / self.queue_depth)
        return waves * self.latency_us * 1e-6 + np.asarray(n_bytes) / (self.bandwidth_gbps * 1e9)


@dataclass(frozen=True)
class MemoryModel:
    """HBM plus the ordered lower tiers, the page size and the overlap option.

    Parameters
    ----------
    hbm_bandwidth_gbps : float
        HBM bandwidth, GB/s; sets the modelled compute time of a layer (reading its kept cache).
    lower : tuple of Tier
        Lower tiers in placement order (evicted pages fill the first until its capacity).
    page : int
        Positions per page (per KV head); >= 1.
    bytes_per_element : int
        2 for fp16/bf16 KV caches, 4 for fp32.
    overlap : bool
        Fetches overlap the previous layer's compute (stall = max(0, fetch - compute)).
    """

    hbm_bandwidth_gbps: float = 4800.0
    lower: tuple[Tier, ...] = field(default_factory=lambda: DEFAULT_TIERS)
    page: int = 16
    bytes_per_element: int = 2
    overlap: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.hbm_bandwidth_gbps, (int, float))
                and not isinstance(self.hbm_bandwidth_gbps, bool)
                and math.isfinite(self.hbm_bandwidth_gbps) and self.hbm_bandwidth_gbps > 0):
            raise TierError(f"hbm_bandwidth_gbps = {self.hbm_bandwidth_gbps!r}: expected a "
                            "finite value > 0")
        from tracesim.counts import PAGE

        PAGE.check(self.page, "page", TierError)  # 1e12 overflowed the int32 page arithmetic
        if self.bytes_per_element not in (1, 2, 4, 8):
            raise TierError(f"bytes_per_element = {self.bytes_per_element!r}: expected 1, 2, 4 "
                            "or 8")
        if not isinstance(self.overlap, bool):
            raise TierError(f"overlap = {self.overlap!r}: expected true or false")
        if not self.lower:
            raise TierError("tiers: at least one lower tier is required")
        names = [t.name for t in self.lower]
        if len(set(names)) != len(names):
            raise TierError(f"tiers: duplicate tier names {names}")

    def token_bytes(self, head_dim: int) -> int:
        """Bytes of one token of one KV head (its key and value)."""
        return 2 * int(head_dim) * self.bytes_per_element

    def placement(self, page_bytes: np.ndarray) -> np.ndarray:
        """Tier index of every evicted page, filling tiers in order (pages in the given order).

        Parameters
        ----------
        page_bytes : ndarray, shape (n_pages,)
            Bytes of each evicted page.

        Returns
        -------
        ndarray of int64, shape (n_pages,)
        """
        page_bytes = np.asarray(page_bytes, dtype=np.float64)
        end = np.cumsum(page_bytes)
        caps = np.cumsum([t.capacity_gb * 1e9 for t in self.lower])
        tier = np.searchsorted(caps, end, side="left")
        if tier.size and tier.max() >= len(self.lower):
            raise TierError(f"tiers: {end[-1] / 1e9:.3g} GB of evicted pages exceed the total "
                            f"capacity of the lower tiers ({caps[-1] / 1e9:.3g} GB)")
        return tier.astype(np.int64)

    def step_times(self, n_fetches: np.ndarray, n_bytes: np.ndarray,
                   kept_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Modelled fetch time and stall of (step, layer) units, seconds.

        Parameters
        ----------
        n_fetches, n_bytes : ndarray, shape (n_units, n_tiers)
            Fetches and bytes per lower tier.
        kept_bytes : ndarray, shape (n_units,)
            Bytes of the layer's kept cache (its modelled compute time reads them from HBM).

        Returns
        -------
        fetch_s, stall_s : ndarray, shape (n_units,)
        """
        n_fetches = np.atleast_2d(n_fetches)
        n_bytes = np.atleast_2d(n_bytes)
        per_tier = np.stack([t.fetch_seconds(n_fetches[:, i], n_bytes[:, i])
                             for i, t in enumerate(self.lower)], axis=1)
        fetch = per_tier.max(axis=1)
        if not self.overlap:
            return fetch, fetch
        compute = np.asarray(kept_bytes, dtype=np.float64) / (self.hbm_bandwidth_gbps * 1e9)
        return fetch, np.maximum(0.0, fetch - compute)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (the ``tiers.yaml`` form) for summaries and hashing."""
        return {"hbm_bandwidth_gbps": self.hbm_bandwidth_gbps, "page": self.page,
                "bytes_per_element": self.bytes_per_element, "overlap": self.overlap,
                "tiers": [{f.name: getattr(t, f.name) for f in fields(t)} for t in self.lower]}


DEFAULT_TIERS: tuple[Tier, ...] = (
    Tier("dram", bandwidth_gbps=64.0, latency_us=10.0, capacity_gb=512.0, queue_depth=8),
    Tier("nvme", bandwidth_gbps=14.0, latency_us=80.0, capacity_gb=7680.0, queue_depth=64),
)

_MODEL_KEYS = {"hbm_bandwidth_gbps", "page", "bytes_per_element", "overlap", "tiers"}
_TIER_KEYS = {"name", "bandwidth_gbps", "latency_us", "capacity_gb", "queue_depth"}


def memory_model_from_dict(doc: Any, where: str = "tiers.yaml") -> MemoryModel:
    """Validate the ``memory`` mapping of a tiers spec and build the model."""
    if doc is None:
        return MemoryModel()
    if not isinstance(doc, dict):
        raise TierError(f"{where}: expected a mapping, got {type(doc).__name__}")
    unknown = set(doc) - _MODEL_KEYS
    if unknown:
        raise TierError(f"{where}: unknown field(s) {sorted(unknown)}; expected some of "
                        f"{sorted(_MODEL_KEYS)}")
    kwargs = {k: doc[k] for k in ("hbm_bandwidth_gbps", "page", "bytes_per_element", "overlap")
              if k in doc}
    if "hbm_bandwidth_gbps" in kwargs and isinstance(kwargs["hbm_bandwidth_gbps"], int):
        kwargs["hbm_bandwidth_gbps"] = float(kwargs["hbm_bandwidth_gbps"])
    if "tiers" in doc:
        raw = doc["tiers"]
        if not isinstance(raw, list) or not raw:
            raise TierError(f"{where}.tiers: expected a non-empty list of tiers")
        tiers = []
        for i, t in enumerate(raw):
            if not isinstance(t, dict) or "name" not in t or "bandwidth_gbps" not in t:
                raise TierError(f"{where}.tiers[{i}]: expected a mapping with at least name "
                                "and bandwidth_gbps")
            bad = set(t) - _TIER_KEYS
            if bad:
                raise TierError(f"{where}.tiers[{i}]: unknown field(s) {sorted(bad)}")
            args = dict(t)
            for k in ("bandwidth_gbps", "latency_us", "capacity_gb"):
                if k in args and isinstance(args[k], int) and not isinstance(args[k], bool):
                    args[k] = float(args[k])
            if args.get("capacity_gb") in ("inf", ".inf"):
                args["capacity_gb"] = math.inf
            try:
                tiers.append(Tier(name=str(args.pop("name")), **args))
            except TierError as exc:
                raise TierError(f"{where}.tiers[{i}]: {exc}") from None
            except TypeError as exc:
                raise TierError(f"{where}.tiers[{i}]: {exc}") from None
        kwargs["lower"] = tuple(tiers)
    try:
        return MemoryModel(**kwargs)
    except TierError as exc:
        raise TierError(f"{where}: {exc}") from None


def load_memory_model(path: str | Path) -> MemoryModel:
    """Read the ``memory`` section of a tiers spec file (:func:`tracesim.safeio.read_yaml`)."""
    from tracesim.safeio import read_yaml

    doc = read_yaml(path, "tiers spec", error=TierError)
    if doc is not None and not isinstance(doc, dict):
        raise TierError(f"{path}: expected a mapping with 'memory' at the top level")
    return memory_model_from_dict((doc or {}).get("memory"), f"{path}: memory")
