"""Third-party scores and designs: entry points, an in-process decorator, aliases, provenance.

Two ways to add a score (a :class:`~tracesim.policies.Score` subclass) or a design (a
:class:`~tracesim.designs.Design` subclass) without editing tracesim:

- an installed distribution that declares it under the entry-point group ``tracesim.scores``
  (or ``tracesim.designs``), e.g. in ``pyproject.toml``::

      [project.entry-points."tracesim.scores"]
      my_score = "my_package.scores:MyScore"

  Every process that can import the distribution finds it: the driver, local pool workers and
  Dask workers alike. This is how sweeps use plugins.
- :func:`register_score` / :func:`register_design` as a class decorator, for in-process use
  (notebooks, :func:`tracesim.replay.replay`). Sweeps refuse such scores, because their workers
  are other processes that never ran the decorator.

A spec names a plugin by its registry name only: nothing in a spec is imported or executed;
names are looked up among the built-ins, their aliases, decorator registrations and the
declared entry points, in that order. Built-in names cannot be overridden.

:func:`provenance` gives a plugin's distribution name, version and a sha256 of its source files
as they are on disk; sweeps put it into the result hash, so an edited or upgraded plugin never
mixes its rows with the old ones, and workers refuse to run when their plugin differs from the
driver's.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import inspect
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from tracesim.provenance import source_digest

__all__ = ["DESIGN_GROUP", "SCORE_GROUP", "Registry", "plugin_provenance", "provenance",
           "register_design", "register_score"]

SCORE_GROUP = "tracesim.scores"
DESIGN_GROUP = "tracesim.designs"

T = TypeVar("T", bound=type)


class Registry(Mapping):
    """Name -> class of one kind (scores or designs): built-ins, aliases, plugins.

    Iteration lists canonical names only (built-ins, decorator registrations and entry points);
    aliases resolve on lookup. Entry points are loaded lazily, when their name is first looked up.

    Parameters
    ----------
    kind : str
        ``"score"`` or ``"design"`` (messages).
    group : str
        Entry-point group.
    builtins : dict
        The built-in classes by name (not copied: later additions are seen).
    base : type
        Base class every plugin must subclass.
    """

    def __init__(self, kind: str, group: str, builtins: dict[str, type], base: type) -> None:
        self.kind, self.group, self.base = kind, group, base
        self.builtins = builtins
        self.aliases: dict[str, tuple[str, dict[str, Any]]] = {}
        self.registered: dict[str, type] = {}
        self._loaded: dict[str, type] = {}
        #: source hash of each plugin as it was when this process loaded / registered it
        self.loaded_hash: dict[str, str] = {}

    # -- entry points ----------------------------------------------------------------------
    def entry_points(self) -> dict[str, md.EntryPoint]:
        """Declared entry points of the group by name (first distribution on sys.path wins)."""
        out: dict[str, md.EntryPoint] = {}
        for ep in md.entry_points(group=self.group):
            out.setdefault(ep.name, ep)
        return out

    def _load(self, name: str) -> type | None:
        if name in self._loaded:
            return self._loaded[name]
        ep = self.entry_points().get(name)
        if ep is None:
            return None
        try:
            cls = ep.load()
        except Exception as exc:  # noqa: BLE001 - a broken plugin is reported, never hidden
            raise ValueError(f"{self.kind} plugin {name!r} (entry point {ep.value!r} of "
                             f"{_dist_name(ep)!r}) failed to import: "
                             f"{type(exc).__name__}: {exc}") from None
        self._check(name, cls, f"entry point {ep.value!r}")
        self._loaded[name] = cls
        self.loaded_hash[name] = source_hash(cls)
        return cls

    def _check(self, name: str, cls: Any, where: str) -> None:
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise ValueError(f"{self.kind} plugin {name!r} ({where}) is not a subclass of "
                             f"{self.base.__module__}.{self.base.__name__}")
        if getattr(cls, "name", None) != name:
            raise ValueError(f"{self.kind} plugin {name!r} ({where}): its class attribute "
                             f"name is {getattr(cls, 'name', None)!r}, expected {name!r}")

    # -- mapping ---------------------------------------------------------------------------
    def canonical(self, name: str) -> tuple[str, dict[str, Any]]:
        """``(canonical name, preset hyperparameters)`` of a name or alias."""
        if name in self.aliases and name not in self.builtins:
            return self.aliases[name]
        return name, {}

    def __getitem__(self, name: str) -> type:
        if not isinstance(name, str):
            raise KeyError(name)
        name, _ = self.canonical(name)
        if name in self.builtins:
            return self.builtins[name]
        if name in self.registered:
            return self.registered[name]
        cls = self._load(name)
        if cls is None:
            raise KeyError(name)
        return cls

    def __contains__(self, name: object) -> bool:
        try:
            self[name]  # type: ignore[index]
        except KeyError:
            return False
        return True

    def names(self) -> list[str]:
        """Canonical names: built-ins, decorator registrations, entry points (not loaded)."""
        out = dict.fromkeys(self.builtins)
        out.update(dict.fromkeys(self.registered))
        out.update(dict.fromkeys(n for n in self.entry_points() if n not in out))
        return list(out)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def is_plugin(self, name: str) -> bool:
        """Whether ``name`` (canonical) is not a built-in."""
        return self.canonical(name)[0] not in self.builtins

    def register(self, cls: T, name: str | None = None) -> T:
        """Register ``cls`` under ``name`` (default ``cls.name``) for this process."""
        name = name or getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"cannot register {cls!r}: give it a class attribute 'name'")
        if name in self.builtins or name in self.aliases:
            raise ValueError(f"{self.kind} name {name!r} is taken by a built-in or an alias; "
                             "choose another name")
        self._check(name, cls, "decorator")
        self.registered[name] = cls
        self.loaded_hash[name] = source_hash(cls)
        return cls

    def build(self, name: str, params: dict[str, Any]) -> Any:
        """``cls(**{**alias presets, **params})`` with errors naming the kind and the choices."""
        try:
            cls = self[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; expected one of "
                             f"{sorted(self.names())} or an alias of one "
                             f"({', '.join(sorted(self.aliases))})") from None
        try:
            return cls(**{**self.canonical(name)[1], **params})
        except TypeError as exc:
            raise ValueError(f"{self.kind} {name!r}: {exc}") from None


def _registries() -> tuple[Registry, Registry]:
    from tracesim.designs import DESIGN_REGISTRY
    from tracesim.policies import SCORE_REGISTRY

    return SCORE_REGISTRY, DESIGN_REGISTRY


def register_score(cls: T | None = None, *, name: str | None = None) -> Any:
    """Class decorator registering a :class:`~tracesim.policies.Score` for in-process use.

    >>> @register_score                                       # doctest: +SKIP
    ... @dataclass(frozen=True)
    ... class Mine(Score):
    ...     name: ClassVar[str] = "mine"
    """
    def wrap(c: T) -> T:
        return _registries()[0].register(c, name)
    return wrap if cls is None else wrap(cls)


def register_design(cls: T | None = None, *, name: str | None = None) -> Any:
    """Class decorator registering a :class:`~tracesim.designs.Design` for in-process use."""
    def wrap(c: T) -> T:
        return _registries()[1].register(c, name)
    return wrap if cls is None else wrap(cls)


# ------------------------------------------------------------------------------ provenance

def _dist_name(ep: md.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else ""


def _source_files(module: Any) -> list[Path]:
    """The .py files of the top-level package (or the single module) defining a class."""
    top = sys.modules.get(module.__name__.split(".")[0], module)
    file = getattr(top, "__file__", None)
    if file is None:
        return []
    path = Path(file).resolve()
    if path.name == "__init__.py":
        return sorted(path.parent.rglob("*.py"))
    return [path]


def source_hash(cls: type) -> str:
    """``sha256:<hex>`` of the source files (as on disk now) of the package defining ``cls``."""
    module = sys.modules.get(cls.__module__)
    files = _source_files(module) if module is not None else []
    if files:
        return "sha256:" + source_digest(files[0].parent, files)
    h = hashlib.sha256()  # defined interactively: hash what inspect can see
    try:
        h.update(inspect.getsource(cls).encode())
    except (OSError, TypeError):
        h.update(cls.__qualname__.encode())
    return "sha256:" + h.hexdigest()


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
    reg = _registries()[0 if kind == "score" else 1]
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
        dist = _dist_name(ep)
        version = ep.dist.version if getattr(ep, "dist", None) is not None else ""
        source = "entry_point"
    return {"kind": kind, "name": canon, "source": source, "distribution": dist,
            "version": version, "class": f"{cls.__module__}:{cls.__qualname__}",
            "source_hash": (reg.loaded_hash[canon] if as_loaded else source_hash(cls))}


def plugin_provenance(policies: Any, as_loaded: bool = False) -> list[dict[str, str]]:
    """Provenance of every plugin score and design used by ``policies`` (sorted, unique)."""
    scores, designs = _registries()
    seen: dict[tuple[str, str], dict[str, str]] = {}
    for p in policies:
        if scores.is_plugin(p.score.name):
            seen.setdefault(("score", p.score.name),
                            provenance("score", p.score.name, as_loaded))
        d = getattr(p, "design", None)
        if d is not None and designs.is_plugin(d.name):
            seen.setdefault(("design", d.name), provenance("design", d.name, as_loaded))
    return [seen[k] for k in sorted(seen)]


def in_process_only(provs: list[dict[str, str]]) -> list[str]:
    """Names of plugins registered by decorator only (no entry point workers could load)."""
    return [p["name"] for p in provs if p["source"] == "decorator"]

