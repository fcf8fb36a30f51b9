"""Third-party components: entry points, in-process registration, provenance.

Five kinds of component can be added without editing tracesim: a score (a
:class:`~tracesim.policies.Score` subclass), a design (a :class:`~tracesim.designs.Design`
subclass), a per-step designs' query proxy (a :class:`~tracesim.proxies.Proxy` subclass), a
fetch scheduler of ``tracesim tiers`` (a :class:`~tracesim.tiers.Scheduler` instance) and a
claim of the report (a :class:`~tracesim.analysis.claims.Claim` instance, named by its id).
Their registries live in :mod:`tracesim.registry`; this module re-exports the registration
functions of the first three (:func:`tracesim.tiers.register_scheduler` and
:func:`tracesim.analysis.claim_registry.register_claim` live with their kinds) and adds
provenance. Two ways in:

- an installed distribution that declares it under the entry-point group ``tracesim.scores``
  (or ``tracesim.designs``, ``tracesim.proxies``, ``tracesim.schedulers``,
  ``tracesim.claims``), e.g. in ``pyproject.toml``::

      [project.entry-points."tracesim.scores"]
      my_score = "my_package.scores:MyScore"

      [project.entry-points."tracesim.schedulers"]
      my_fetch = "my_package.fetch:MY_FETCH"      # a Scheduler whose name is my_fetch

  Every process that can import the distribution finds it: the driver, local pool workers and
  Dask workers alike. This is how sweeps, ``tracesim tiers``, the in-loop fetch and
  ``tracesim report`` use plugins.
- :func:`register_score` / :func:`register_design` / :func:`register_proxy` as a class
  decorator or a plain call (or the register call of a scheduler or claim), for in-process use
  (notebooks, :func:`tracesim.replay.replay`). Sweeps and Dask runs of ``tracesim tiers``
  refuse such plugins, because their workers are other processes that never ran it.

A spec names a plugin by its registry name only: nothing in a spec is imported or executed;
names are looked up among the built-ins, their aliases, decorator registrations and the
declared entry points, in that order. Built-in names cannot be overridden.

:func:`provenance` gives a plugin's distribution name, version and a sha256 of its source files
as they are on disk; sweeps put it into the result hash, so an edited or upgraded plugin never
mixes its rows with the old ones, and workers refuse to run when their plugin differs from the
driver's. A plugin scheduler's hash enters the tiers spec hash the same way, and a plugin
claim's provenance is written with its row of the report's ``claims.json``.
"""

from __future__ import annotations

import importlib.metadata as md
from typing import Any

from tracesim.registry import (
    CLAIM_GROUP,
    CLAIM_REGISTRY,
    DESIGN_GROUP,
    DESIGN_REGISTRY,
    PROXY_GROUP,
    PROXY_REGISTRY,
    SCHEDULER_GROUP,
    SCHEDULER_REGISTRY,
    SCORE_GROUP,
    SCORE_REGISTRY,
    Registry,
    dist_name,
    register_design,
    register_proxy,
    register_score,
    source_hash,
)

__all__ = ["CLAIM_GROUP", "DESIGN_GROUP", "PROXY_GROUP", "SCHEDULER_GROUP", "SCORE_GROUP",
           "Registry", "in_process_only",
           "plugin_provenance", "provenance", "register_design", "register_proxy",
           "register_score", "source_hash"]

#: kind -> its registry (the ``kind`` of :func:`provenance`).
_REGISTRIES: dict[str, Registry] = {"score": SCORE_REGISTRY, "design": DESIGN_REGISTRY,
                                    "proxy": PROXY_REGISTRY, "scheduler": SCHEDULER_REGISTRY,
                                    "claim": CLAIM_REGISTRY}


def _defined_in(entry: Any) -> tuple[str, str]:
    """``(module, qualified name)`` of a plugin: its class, or for a scheduler or claim (an
    instance) the function that carries its rule."""
    if isinstance(entry, type):
        return entry.__module__, entry.__qualname__
    rule = getattr(entry, "priority", None) or getattr(entry, "evaluate", None)
    rule = getattr(rule, "py_func", rule)
    return (getattr(rule, "__module__", type(entry).__module__),
            getattr(rule, "__qualname__", type(entry).__qualname__))


def provenance(kind: str, name: str, as_loaded: bool = False) -> dict[str, str]:
    """Where a plugin comes from: ``name``, ``kind``, ``source`` (``entry_point`` or
    ``decorator``), ``distribution``, ``version``, ``class`` and ``source_hash``.

    ``source_hash`` is read from disk now, or with ``as_loaded`` the hash the files had when
    this process imported the plugin (what a worker actually runs).

    Raises
    ------
    ValueError
        If ``name`` is a built-in or unknown.
    """
    reg = _REGISTRIES[kind]
    canon, _ = reg.canonical(name)
    if canon in reg.builtins:
        raise ValueError(f"{kind} {name!r} is a built-in, not a plugin")
    module, qualname = _defined_in(reg[canon])
    if canon in reg.registered:
        top = module.split(".")[0]
        dists = md.packages_distributions().get(top, [])
        dist = dists[0] if dists else ""
        version = md.version(dist) if dist else ""
        source = "decorator"
    else:
        ep = reg.entry_points()[canon]
        dist = dist_name(ep)
        version = ep.dist.version if getattr(ep, "dist", None) is not None else ""
        source = "entry_point"
    return {"kind": kind, "name": canon, "source": source, "distribution": dist,
            "version": version, "class": f"{module}:{qualname}",
            "source_hash": (reg.loaded_hash[canon] if as_loaded else reg.digest(reg[canon]))}


def plugin_provenance(policies: Any, as_loaded: bool = False) -> list[dict[str, str]]:
    """Provenance of every plugin score, design and proxy used by ``policies`` (sorted, unique).

    A proxy is named by the ``proxy`` spec of a per-step score (``quant:4`` -> ``quant``).
    """
    seen: dict[tuple[str, str], dict[str, str]] = {}

    def note(kind: str, name: str) -> None:
        if _REGISTRIES[kind].is_plugin(name):
            seen.setdefault((kind, name), provenance(kind, name, as_loaded))

    for p in policies:
        note("score", p.score.name)
        d = getattr(p, "design", None)
        if d is not None:
            note("design", d.name)
        proxy = getattr(p.score, "proxy", None) if p.score.per_step else None
        if isinstance(proxy, str):
            note("proxy", proxy.partition(":")[0])
    return [seen[k] for k in sorted(seen)]


def in_process_only(provs: list[dict[str, str]]) -> list[str]:
    """Names of plugins registered by decorator only (no entry point workers could load)."""
    return [p["name"] for p in provs if p["source"] == "decorator"]

