"""Sweep specs: a YAML file (read by :func:`tracesim.safeio.read_yaml`) validated into a
:class:`SweepSpec`.

Nothing in a spec is executed or imported. Every problem is reported before any work starts,
as ``<file>: <key>: <what is wrong>``. Relative paths in a spec file are relative to the
directory of the file. The grammar is documented in ``docs/sweeps.md``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tracesim.counts import SEQUENCES
from tracesim.digests import source_digest
from tracesim.policies import Policy
from tracesim.policies.grid import SpecError, expand_grid
from tracesim.replay.engine import ReplayOptions
from tracesim.sweep.fields import (  # noqa: F401 - MAX_* are part of this module's API
    MAX_LAYER,
    MAX_SEED,
    MAX_SEEDS,
    _int,
    _layers,
    _options,
    _prereg,
    _resolved,
    _seeds,
    _str_list,
    _type_name,
)

__all__ = ["SPEC_KEYS", "SWEEP_FORMAT", "SequenceFilter", "SpecError", "StoreRef", "SweepSpec",
           "code_fingerprint", "load_spec", "parse_spec", "selected_sequences"]

#: Version of the task-file layout and spec hash; bump when either changes meaning.
SWEEP_FORMAT = 1

#: Top-level keys -> meaning (``docs/sweeps.md`` has the full grammar).
SPEC_KEYS: dict[str, str] = {
    "version": "grammar version (1)",
    "name": "label of the sweep (default: the file name without .yaml)",
    "store": "trace store path, list of paths, or list of {path, name}",
    "sequences": "filter {ids: [...], tasks: [...], limit: N} (default: every sequence)",
    "layers": "'all' (default), an int, a list of ints, or {start, stop, step}",
    "grid": "the policy grid (see tracesim.policies.grid)",
    "seeds": "number of seeds n (0..n-1) or a list of distinct ints (default 32)",
    "record": "'aggregated' (default: means over seeds) or 'per_seed'",
    "options": "replay options {alpha, output_space, satterthwaite, roles, precision, "
               "bootstrap}",
    "partition": "{layers_per_task: int (default 1), max_task_memory_mb: int (default 1024)}",
    "output": "output directory (or --out)",
    "prereg": "pre-registration file whose sha256 the summary records",
}
_SEQ_KEYS = ("ids", "tasks", "limit")
_PARTITION_KEYS = ("layers_per_task", "max_task_memory_mb")
MAX_SPEC_BYTES = 1 << 20  # size of a spec file (docs/sweeps.md, "Limits")


def _hashed_options(options: ReplayOptions) -> dict[str, Any]:
    """The options as hashed: ``bootstrap`` only when on, so specs without it keep the hash
    (and the finished task files) they had before the option existed."""
    doc = asdict(options)
    if not doc["bootstrap"]:
        del doc["bootstrap"]
    return doc


def code_fingerprint() -> str:
    """sha256 of tracesim's source that can affect result rows, read from disk now.

    Every ``.py`` file of the installed ``tracesim`` package except the ``sweep`` package and
    the ``cli.py`` modules. Part of the result hash, so a sweep never mixes rows computed by
    two versions of the engine; workers compare it with the fingerprint of the code they
    loaded (:data:`tracesim.sweep.worker.LOADED_CODE`).
    """
    import tracesim

    root = Path(tracesim.__file__).resolve().parent
    return source_digest(root, [
        path for path in sorted(root.rglob("*.py"))
        if not (path.relative_to(root).as_posix().startswith("sweep/") or path.name == "cli.py")])


@dataclass(frozen=True)
class StoreRef:
    """A trace store of the sweep: its label (the ``store`` result column) and path."""

    name: str
    path: Path


@dataclass(frozen=True)
class SequenceFilter:
    """Which sequences of each store to replay (``None`` = no restriction)."""

    ids: tuple[str, ...] | None = None
    tasks: tuple[str, ...] | None = None
    limit: int | None = None


@dataclass(frozen=True)
class SweepSpec:
    """A validated sweep.

    Attributes
    ----------
    source : str
        Where the spec came from (file path or ``"<dict>"``), used in messages.
    policies : tuple of Policy
        The expanded grid (spec order, unique ids).
    layers : tuple of int or None
        ``None`` = every layer of each store.
    skipped : tuple of str
        Grid combinations left out as incompatible (e.g. fixed-size design × decode schedule).
    """

    source: str
    name: str
    stores: tuple[StoreRef, ...]
    sequences: SequenceFilter
    layers: tuple[int, ...] | None
    policies: tuple[Policy, ...]
    seeds: tuple[int, ...]
    record: str
    options: ReplayOptions
    output: Path | None
    layers_per_task: int = 1
    max_task_memory_mb: int = 1024
    prereg: Path | None = None
    skipped: tuple[str, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def per_seed(self) -> bool:
        return self.record == "per_seed"

    def result_hash(self, code: str | None = None) -> str:
        """sha256 of everything that affects result rows (not paths, partition or output):
        tracesim's version and source (``code``, default :func:`code_fingerprint` now),
        configurations, seeds, record mode, replay options and the provenance of plugin
        scores / designs (:func:`tracesim.plugins.plugin_provenance`)."""
        from tracesim.version import __version__

        code = code_fingerprint() if code is None else code
        doc = {"format": SWEEP_FORMAT, "version": __version__, "code": code,
               "configs": [p.to_json() for p in self.policies], "seeds": list(self.seeds),
               "record": self.record, "options": _hashed_options(self.options)}
        from tracesim.plugins import plugin_provenance

        plugins = plugin_provenance(self.policies)
        if plugins:  # a plugin's distribution, version and source hash (docs/extending.md)
            doc["plugins"] = plugins
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _stores(value: Any, where: str, base: Path) -> tuple[StoreRef, ...]:
    from tracesim.store import StoreError, open_store

    items = value if isinstance(value, list) else [value]
    if not items:
        raise SpecError(f"{where}: is empty; give a trace store directory")
    refs: list[StoreRef] = []
    for i, item in enumerate(items):
        key = f"{where}[{i}]" if isinstance(value, list) else where
        if isinstance(item, Mapping):
            bad = [k for k in item if k not in ("path", "name")]
            if bad:
                raise SpecError(f"{key}.{bad[0]}: unknown key; expected 'path' and 'name'")
            path, name = item.get("path"), item.get("name")
        else:
            path, name = item, None
        if not isinstance(path, str) or not path:
            raise SpecError(f"{key}: expected a store directory (a string), got {path!r}")
        try:
            full = (base / path).resolve()
        except RuntimeError:  # a symlink loop (Python < 3.13)
            raise SpecError(f"{key}: {path!r} is a symlink loop, expected a store directory") \
                from None
        name = name if name is not None else full.name
        if not isinstance(name, str) or not name:
            raise SpecError(f"{key}.name: expected a non-empty string, got {name!r}")
        try:
            open_store(full, require_rows=True)
        except StoreError as exc:
            raise SpecError(f"{key}: cannot open trace store {str(full)!r}: {exc}") from None
        if any(r.name == name for r in refs):
            raise SpecError(f"{key}: store name {name!r} used twice; give each a 'name'")
        refs.append(StoreRef(name=name, path=full))
    return tuple(refs)


def _sequence_filter(value: Any, where: str) -> SequenceFilter:
    if value is None:
        return SequenceFilter()
    if not isinstance(value, Mapping):
        raise SpecError(f"{where}: expected a mapping {{ids, tasks, limit}}, got {value!r}")
    for key in value:
        if key not in _SEQ_KEYS:
            raise SpecError(f"{where}.{key}: unknown key; expected one of {list(_SEQ_KEYS)}")
    ids = _str_list(value["ids"], f"{where}.ids") if "ids" in value else None
    if ids is not None:
        SEQUENCES.check_items(ids, f"{where}.ids", SpecError)
    tasks = _str_list(value["tasks"], f"{where}.tasks") if "tasks" in value else None
    limit = _int(value["limit"], f"{where}.limit", 1) if "limit" in value else None
    return SequenceFilter(ids, tasks, limit)


def selected_sequences(store: Any, flt: SequenceFilter) -> list[str]:
    """Sequence ids of ``store`` the filter keeps (manifest order, then ``limit``)."""
    tasks = store.manifest.column("task").to_pylist()
    out = [sid for sid, task in zip(store.sequence_ids, tasks, strict=True)
           if (flt.ids is None or sid in flt.ids) and (flt.tasks is None or task in flt.tasks)]
    return out[:flt.limit] if flt.limit is not None else out


def _check_selection(spec: SweepSpec, where: str) -> None:
    """Every id exists somewhere, some sequence is selected, layers and roles exist."""
    from tracesim.store import open_store

    found: set[str] = set()
    total = 0
    wanted = spec.options.roles
    oracle = any(p.score.name == "oracle" for p in spec.policies)
    for ref in spec.stores:
        store = open_store(ref.path, require_rows=True)
        found.update(s for s in store.sequence_ids if spec.sequences.ids is None
                     or s in spec.sequences.ids)
        n_layers = store.model.n_layers
        for layer in spec.layers or ():
            if layer >= n_layers:
                raise SpecError(f"{where}: layers: layer {layer} does not exist in store "
                                f"{ref.name!r} ({n_layers} layers)")
        ids = selected_sequences(store, spec.sequences)
        total += len(ids)
        roles_col = store.manifest.column("query_roles").to_pylist()
        row = {s: i for i, s in enumerate(store.sequence_ids)}
        for sid in ids:
            roles = set(roles_col[row[sid]])
            ok = roles & set(wanted) if wanted else roles & {"decode", "question_window"}
            if not ok:
                raise SpecError(f"{where}: options.roles: sequence {sid!r} of store "
                                f"{ref.name!r} stores no query with role "
                                f"{list(wanted) if wanted else ['decode', 'question_window']}")
            if oracle and "decode" not in roles:
                raise SpecError(f"{where}: grid.score: 'oracle' scores with the decode "
                                f"queries, and sequence {sid!r} of store {ref.name!r} stores "
                                "none")
    for i, sid in enumerate(spec.sequences.ids or ()):
        if sid not in found:
            raise SpecError(f"{where}: sequences.ids[{i}]: no store has sequence {sid!r}")
    if total == 0:
        raise SpecError(f"{where}: sequences: the filter selects no sequence")


def parse_spec(doc: Any, *, source: str = "<dict>", base_dir: str | Path | None = None,
               output: str | Path | None = None) -> SweepSpec:
    """Validate a loaded spec mapping.

    Parameters
    ----------
    doc : mapping
        The spec (:func:`tracesim.safeio.read_yaml` output or a dict with the same keys,
        :data:`SPEC_KEYS`).
    source : str
        Name used at the start of error messages.
    base_dir : path, optional
        Directory relative paths are resolved against (default: the current directory).
    output : path, optional
        Overrides the spec's ``output``.

    Raises
    ------
    SpecError
        Naming the source and the key.
    """
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    if not isinstance(doc, Mapping):
        raise SpecError(f"{source}: expected a mapping of {sorted(SPEC_KEYS)} at the top level, "
                        f"got {_type_name(doc)}")
    for key in doc:
        if key not in SPEC_KEYS:
            raise SpecError(f"{source}: {key}: unknown key; expected one of {sorted(SPEC_KEYS)}")
    if doc.get("version", 1) != 1:
        raise SpecError(f"{source}: version: {doc['version']!r} is not supported (expected 1)")
    for key in ("store", "grid"):
        if key not in doc:
            raise SpecError(f"{source}: {key}: missing; {SPEC_KEYS[key]}")
    name = doc.get("name", Path(source).stem if source != "<dict>" else "sweep")
    if not isinstance(name, str) or not name:
        raise SpecError(f"{source}: name: expected a non-empty string, got {name!r}")
    record = doc.get("record", "aggregated")
    if record not in ("aggregated", "per_seed"):
        raise SpecError(f"{source}: record: expected 'aggregated' or 'per_seed', got {record!r}")
    part = doc.get("partition") or {}
    if not isinstance(part, Mapping):
        raise SpecError(f"{source}: partition: expected a mapping of {list(_PARTITION_KEYS)}")
    for key in part:
        if key not in _PARTITION_KEYS:
            raise SpecError(f"{source}: partition.{key}: unknown key; expected one of "
                            f"{list(_PARTITION_KEYS)}")
    out = output if output is not None else doc.get("output")
    if out is not None and (not isinstance(out, (str, Path)) or not str(out)):
        raise SpecError(f"{source}: output: expected a directory path, got {out!r}")
    prereg = doc.get("prereg")
    if prereg is not None:
        prereg = _prereg(prereg, base, source)
    grid = expand_grid(doc["grid"], f"{source}: grid")
    spec = SweepSpec(
        source=source, name=name, stores=_stores(doc["store"], f"{source}: store", base),
        sequences=_sequence_filter(doc.get("sequences"), f"{source}: sequences"),
        layers=_layers(doc.get("layers"), f"{source}: layers"),
        policies=tuple(grid.policies),
        seeds=_seeds(doc.get("seeds", 32), f"{source}: seeds"), record=record,
        options=_options(doc.get("options"), f"{source}: options"),
        output=None if out is None else _resolved(base / out if output is None else Path(out),
                                                  f"{source}: output"),
        layers_per_task=_int(part.get("layers_per_task", 1),
                             f"{source}: partition.layers_per_task", 1),
        max_task_memory_mb=_int(part.get("max_task_memory_mb", 1024),
                                f"{source}: partition.max_task_memory_mb", 16),
        prereg=prereg, skipped=tuple(grid.skipped), raw=dict(doc))
    if spec.output is not None:  # never write into a store, over the spec or the prereg
        from tracesim.outpaths import check_output

        check_output(spec.output, [*((f"trace store {r.name!r}", r.path) for r in spec.stores),
                                   ("sweep spec", None if source == "<dict>" else source),
                                   ("pre-registration file", prereg)],
                     f"{source}: output", SpecError)
    _check_selection(spec, source)
    return spec


def load_spec(path: str | Path, *, output: str | Path | None = None) -> SweepSpec:
    """Read a YAML spec with :func:`tracesim.safeio.read_yaml` (regular file, size and depth
    limits, no aliases, no duplicate keys) and validate it (see :func:`parse_spec`)."""
    from tracesim.safeio import read_yaml

    path = Path(path)
    try:
        doc = read_yaml(path, "sweep spec", limit=MAX_SPEC_BYTES, error=SpecError)
    except FileNotFoundError:
        raise SpecError(f"{path}: cannot read the spec: no such file, expected a YAML spec "
                        "file") from None
    return parse_spec(doc, source=str(path), base_dir=path.parent.resolve(), output=output)
