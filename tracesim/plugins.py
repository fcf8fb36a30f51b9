"""Third-party scores, designs and proxies: entry points, in-process registration, provenance.

Three kinds of component can be added without editing tracesim: a score (a
:class:`~tracesim.policies.Score` subclass), a design (a :class:`~tracesim.designs.Design`
subclass) and a per-step designs' query proxy (a :class:`~tracesim.proxies.Proxy` subclass).
Their registries live in :mod:`tracesim.registry`; this module re-exports the registration
functions and adds provenance. Two ways in:

- an installed distribution that declares it under the entry-point group ``tracesim.scores``
  (or ``tracesim.designs``, ``tracesim.proxies``), e.g. in ``pyproject.toml``::

      [project.entry-points."tracesim.scores"]
      my_score = "my_package.scores:MyScore"

  Every process that can import the distribution finds it: the driver, local pool workers and
  Dask workers alike. This is how sweeps use plugins.
- :func:`register_score` / :func:`register_design` / :func:`register_proxy` as a class
  decorator or a plain call, for in-process use (notebooks, :func:`tracesim.replay.replay`).
  Sweeps refuse such plugins, because their workers are other processes that never ran it.

A spec names a plugin by its registry name only: nothing in a spec is imported or executed;
names are looked up among the built-ins, their aliases, decorator registrations and the
declared entry points, in that order. Built-in names cannot be overridden.

:func:`provenance` gives a plugin's distribution name, version and a sha256 of its source files
as they are on disk; sweeps put it into the result hash, so an edited or upgraded plugin never
mixes its rows with the old ones, and workers refuse to run when their plugin differs from the
driver's.
"""

from __future__ import annotations

import importlib.metadata as md
from typing import Any

from tracesim.registry import (
    DESIGN_GROUP,
    DESIGN_REGISTRY,
    PROXY_GROUP,
    PROXY_REGISTRY,
    SCORE_GROUP,
    SCORE_REGISTRY,
    Registry,
    dist_name,
    register_design,
    register_proxy,
    register_score,
    source_hash,
)

__all__ = ["DESIGN_GROUP", "PROXY_GROUP", "SCORE_GROUP", "Registry", "in_process_only",
           "plugin_provenance", "provenance", "register_design", "register_proxy",
           "register_score", "source_hash"]

#: kind -> its registry (the ``kind`` of :func:`provenance`).
_REGISTRIES: dict[str, Registry] = {"score": SCORE_REGISTRY, "design": DESIGN_REGISTRY,
                                    "proxy": PROXY_REGISTRY}


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
    cls = reg[canon]
    if canon in reg.registered:
        top = cls.__module__.split(".")[0]
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
            "version": version, "class": f"{cls.__module__}:{cls.__qualname__}",
            "source_hash": (reg.loaded_hash[canon] if as_loaded else source_hash(cls))}


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

