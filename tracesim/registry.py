"""The registries of scores, designs, proxies, fetch schedulers and claims: built-ins, plugins.

This module is the ground floor of the component packages: of tracesim it imports only the
leaf :mod:`tracesim.digests` (source digests), and :mod:`tracesim.policies`,
:mod:`tracesim.designs`, :mod:`tracesim.proxies` and :mod:`tracesim.plugins` import it.
Each package hands its built-ins and its base class to its registry when it is imported
(:meth:`Registry.install`); a plugin subclasses that base (scores, designs, proxies) or is an
instance of it (a :class:`~tracesim.tiers.Scheduler`, a :class:`~tracesim.analysis.claims.Claim`),
so the built-ins are always installed by the time a plugin is registered or looked up.

A plugin is found in one of two ways (``docs/extending.md``):

- an installed distribution that declares it under the entry-point group of its kind
  (:data:`SCORE_GROUP`, :data:`DESIGN_GROUP`, :data:`PROXY_GROUP`, :data:`SCHEDULER_GROUP`,
  :data:`CLAIM_GROUP`), loaded when its name is first looked up: every process that can import
  the distribution finds it;
- :func:`register_score` / :func:`register_design` / :func:`register_proxy` (class decorators
  or plain calls), :func:`tracesim.tiers.register_scheduler` and
  :func:`tracesim.analysis.claim_registry.register_claim`, for the current process only.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from tracesim.digests import source_digest

__all__ = ["CLAIM_GROUP", "CLAIM_REGISTRY", "DESIGN_GROUP", "DESIGN_REGISTRY", "PROXY_GROUP",
           "PROXY_REGISTRY", "Registry", "SCHEDULER_GROUP", "SCHEDULER_REGISTRY", "SCORE_GROUP",
           "SCORE_REGISTRY", "dist_name", "functions_hash", "register_design", "register_proxy",
           "register_score", "source_hash"]

SCORE_GROUP = "tracesim.scores"
DESIGN_GROUP = "tracesim.designs"
PROXY_GROUP = "tracesim.proxies"
SCHEDULER_GROUP = "tracesim.schedulers"
CLAIM_GROUP = "tracesim.claims"

T = TypeVar("T", bound=type)


class Registry(Mapping):
    """Name -> entry of one kind (a class, or for schedulers and claims an instance): built-ins,
    aliases, plugins.

    Iteration lists canonical names only (built-ins, decorator registrations and entry points);
    aliases resolve on lookup. Entry points are loaded lazily, when their name is first looked up.

    Parameters
    ----------
    kind : str
        ``"score"``, ``"design"``, ``"proxy"``, ``"scheduler"`` or ``"claim"`` (messages).
    group : str
        Entry-point group.
    instances : bool, default False
        Entries are instances of the base class (a :class:`~tracesim.tiers.Scheduler`, a
        claim), not subclasses of it.
    key : str, default "name"
        The entry's attribute that must equal its registry name (``"id"`` for claims).
    digest : callable, optional
        ``digest(entry) -> "sha256:..."`` of the source an entry runs (default
        :func:`source_hash` of the class; schedulers and claims hash their functions).
    """

    def __init__(self, kind: str, group: str, *, instances: bool = False, key: str = "name",
                 digest: Callable[[Any], str] | None = None) -> None:
        self.kind, self.group = kind, group
        self.instances, self.key = instances, key
        self._digest = digest
        #: the built-in classes by name, handed over by the owning package (:meth:`install`)
        self.builtins: dict[str, type] = {}
        #: base class every plugin must subclass (set by :meth:`install`)
        self.base: type | None = None
        self.aliases: dict[str, tuple[str, dict[str, Any]]] = {}
        self.registered: dict[str, type] = {}
        self._loaded: dict[str, type] = {}
        #: source hash of each plugin as it was when this process loaded / registered it
        self.loaded_hash: dict[str, str] = {}

    def digest(self, entry: Any) -> str:
        """``sha256:...`` of the source files an entry runs, as they are on disk now."""
        return (self._digest or source_hash)(entry)

    def install(self, builtins: dict[str, type], base: type) -> None:
        """Take the owning package's built-ins (not copied: later additions are seen) and base.

        Parameters
        ----------
        builtins : dict
            The built-in classes by registry name.
        base : type
            Base class every plugin must subclass.
        """
        self.builtins, self.base = builtins, base

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
                             f"{dist_name(ep)!r}) failed to import: "
                             f"{type(exc).__name__}: {exc}") from None
        self._check(name, cls, f"entry point {ep.value!r}")
        self._loaded[name] = cls
        self.loaded_hash[name] = self.digest(cls)
        return cls

    def _check(self, name: str, cls: Any, where: str) -> None:
        base = self.base
        if base is None:  # only reachable when the owning package was never imported
            raise ValueError(f"{self.kind} plugin {name!r} ({where}): the {self.kind} registry "
                             "has no base class yet; import the package that defines it first")
        if self.instances:
            if not isinstance(cls, base):
                raise ValueError(f"{self.kind} plugin {name!r} ({where}) is not an instance "
                                 f"of {base.__module__}.{base.__name__}")
        elif not (isinstance(cls, type) and issubclass(cls, base)):
            raise ValueError(f"{self.kind} plugin {name!r} ({where}) is not a subclass of "
                             f"{base.__module__}.{base.__name__}")
        if getattr(cls, self.key, None) != name:
            raise ValueError(f"{self.kind} plugin {name!r} ({where}): its attribute "
                             f"{self.key} is {getattr(cls, self.key, None)!r}, expected "
                             f"{name!r}")

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

    def register(self, cls: Any, name: str | None = None) -> Any:
        """Register ``cls`` under ``name`` (default its ``name``, or ``id`` for claims) for
        this process; registering a name again replaces the earlier entry."""
        name = name or getattr(cls, self.key, None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"cannot register {cls!r}: give it an attribute {self.key!r}")
        if name in self.builtins or name in self.aliases:
            raise ValueError(f"{self.kind} name {name!r} is taken by a built-in or an alias; "
                             "choose another name")
        self._check(name, cls, "decorator")
        self.registered[name] = cls
        self.loaded_hash[name] = self.digest(cls)
        return cls

    def unregister(self, name: str) -> None:
        """Forget an in-process registration (``KeyError`` when there is none)."""
        del self.registered[name]
        self.loaded_hash.pop(name, None)

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


#: Scores (:class:`tracesim.policies.Score`): built-ins, kvpress aliases, plugins.
SCORE_REGISTRY = Registry("score", SCORE_GROUP)
#: Inclusion designs (:class:`tracesim.designs.Design`): built-ins and plugins.
DESIGN_REGISTRY = Registry("design", DESIGN_GROUP)
#: Per-step designs' query proxies (:class:`tracesim.proxies.Proxy`): built-ins and plugins.
PROXY_REGISTRY = Registry("proxy", PROXY_GROUP)


def functions_hash(*functions: Any) -> str:
    """``sha256:<hex>`` of the source files defining some functions (one hash when they share
    their package, else the hashes joined by ``+``); a numba dispatcher is read through
    ``py_func``."""
    parts = list(dict.fromkeys(source_hash(getattr(f, "py_func", f)) for f in functions
                               if f is not None))
    return "+".join(parts)


#: Fetch schedulers of ``tracesim tiers`` (:class:`tracesim.tiers.Scheduler` instances): the
#: built-ins and plugins; an entry's source is that of its two priority rules.
SCHEDULER_REGISTRY = Registry("scheduler", SCHEDULER_GROUP, instances=True,
                              digest=lambda s: functions_hash(s.priority, s.reference))
#: Claims of the report (:class:`tracesim.analysis.claims.Claim` instances, by id): the
#: built-ins and plugins; an entry's source is that of its ``evaluate`` and ``check``.
CLAIM_REGISTRY = Registry("claim", CLAIM_GROUP, instances=True, key="id",
                          digest=lambda c: functions_hash(c.evaluate, c.check))


def register_score(cls: T | None = None, *, name: str | None = None) -> Any:
    """Register a :class:`~tracesim.policies.Score` for in-process use (a class decorator).

    >>> @register_score                                       # doctest: +SKIP
    ... @dataclass(frozen=True)
    ... class Mine(Score):
    ...     name: ClassVar[str] = "mine"
    """
    def wrap(c: T) -> T:
        return SCORE_REGISTRY.register(c, name)
    return wrap if cls is None else wrap(cls)


def register_design(cls: T | None = None, *, name: str | None = None) -> Any:
    """Register a :class:`~tracesim.designs.Design` for in-process use (a class decorator)."""
    def wrap(c: T) -> T:
        return DESIGN_REGISTRY.register(c, name)
    return wrap if cls is None else wrap(cls)


def register_proxy(cls: T | None = None, *, name: str | None = None) -> Any:
    """Register a :class:`~tracesim.proxies.Proxy` for in-process use (a class decorator)."""
    def wrap(c: T) -> T:
        return PROXY_REGISTRY.register(c, name)
    return wrap if cls is None else wrap(cls)


# ------------------------------------------------------------------------------ source hashes

def dist_name(ep: md.EntryPoint) -> str:
    """Name of the distribution that declares an entry point ("" if unknown)."""
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
