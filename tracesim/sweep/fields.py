"""Field validators of a sweep spec (``layers``, ``seeds``, ``options``, ``prereg``, ...).

Each takes the raw value and ``where`` (``<file>: <key>``) and raises
:class:`~tracesim.policies.grid.SpecError` naming it; counts use the shared bounds of
:mod:`tracesim.counts`, checked before anything is expanded.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tracesim.counts import LAYER_INDEX, LAYERS, SEED_VALUE, SEEDS
from tracesim.policies.grid import SpecError
from tracesim.replay.engine import MAX_BOOTSTRAP, ReplayOptions

__all__ = ["MAX_LAYER", "MAX_SEED", "MAX_SEEDS"]

_OPTION_KEYS = {"alpha": "float", "output_space": "bool", "satterthwaite": "bool",
                "roles": "list", "precision": "precision", "bootstrap": "replicates"}
_ROLES = ("context_window", "question_window", "decode", "all")
#: Limits checked before anything is expanded (docs/sweeps.md, "Limits").
MAX_SEEDS = SEEDS.hi  # number of seeds, in either spelling (tracesim.counts)
MAX_SEED = SEED_VALUE.hi  # largest seed value
MAX_LAYER = LAYER_INDEX.hi  # largest layer index (model.json allows at most 4096 layers)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _int(value: Any, where: str, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise SpecError(f"{where}: expected an integer >= {lo}, got {value!r} "
                        f"({_type_name(value)})")
    return value


def _str_list(value: Any, where: str) -> tuple[str, ...]:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise SpecError(f"{where}: is empty; give at least one value or drop the key")
    for i, v in enumerate(items):
        if not isinstance(v, str):
            raise SpecError(f"{where}[{i}]: expected a string, got {v!r} ({_type_name(v)})")
    return tuple(items)


def _layers(value: Any, where: str) -> tuple[int, ...] | None:
    if value is None or value == "all":
        return None
    if isinstance(value, Mapping):
        bad = [k for k in value if k not in ("start", "stop", "step")]
        if bad:
            raise SpecError(f"{where}.{bad[0]}: unknown key; expected start, stop, step")
        if "stop" not in value:
            raise SpecError(f"{where}.stop: missing")
        start = _int(value.get("start", 0), f"{where}.start")
        stop = _int(value["stop"], f"{where}.stop")
        if stop > MAX_LAYER + 1:
            raise SpecError(f"{where}.stop: {stop} is out of range, expected <= "
                            f"{MAX_LAYER + 1}")
        step = _int(value.get("step", 1), f"{where}.step", 1)
        out = tuple(range(start, stop, step))
    elif isinstance(value, list):
        LAYERS.check_items(value, where, SpecError)
        out = tuple(_int(v, f"{where}[{i}]") for i, v in enumerate(value))
    elif isinstance(value, int) and not isinstance(value, bool):
        out = (_int(value, where),)
    else:
        raise SpecError(f"{where}: expected 'all', an int, a list of ints or {{start, stop, "
                        f"step}}, got {value!r}")
    if not out:
        raise SpecError(f"{where}: selects no layer")
    if max(out) > MAX_LAYER:
        raise SpecError(f"{where}: layer {max(out)} is out of range, expected <= {MAX_LAYER}")
    if len(set(out)) != len(out):
        raise SpecError(f"{where}: layers repeat")
    return tuple(sorted(out))


def _seeds(value: Any, where: str) -> tuple[int, ...]:
    if isinstance(value, list):
        if not value:
            raise SpecError(f"{where}: is empty; give a count or a list of ints")
        SEEDS.check_items(value, where, SpecError)  # the cap of the int form, and distinct
        seeds = tuple(_int(v, f"{where}[{i}]") for i, v in enumerate(value))
        if max(seeds) > MAX_SEED:
            raise SpecError(f"{where}: seed {max(seeds)} is out of range, expected seeds in "
                            f"[0, {MAX_SEED}]")
        if len(set(seeds)) != len(seeds):
            raise SpecError(f"{where}: seeds repeat")
        return seeds
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{where}: expected a number of seeds (an int >= 1) or a list of "
                        f"distinct ints >= 0, got {value!r} ({_type_name(value)})")
    if value > MAX_SEEDS:
        raise SpecError(f"{where}: {value} seeds, expected at most {MAX_SEEDS}")
    return tuple(range(value))


def _resolved(path: Path, where: str) -> Path:
    try:
        return path.resolve()
    except RuntimeError:  # a symlink loop (Python < 3.13)
        raise SpecError(f"{where}: {str(path)!r} is a symlink loop, expected a directory path") \
            from None


def _prereg(value: Any, base: Path, source: str) -> Path:
    """The ``prereg`` file: an existing regular file (it is hashed: no FIFO, device, /proc)."""
    from tracesim.safeio import MAX_HASH_BYTES, regular_file

    if not isinstance(value, str) or not value:
        raise SpecError(f"{source}: prereg: {value!r} is not an existing file, expected a path")
    try:
        regular_file(base / value, "pre-registration file", MAX_HASH_BYTES, error=SpecError)
    except FileNotFoundError:
        raise SpecError(f"{source}: prereg: {value!r} is not an existing file, expected a "
                        "path") from None
    except SpecError as exc:
        raise SpecError(f"{source}: prereg: {exc}") from None
    return (base / value).resolve()


def _options(value: Any, where: str) -> ReplayOptions:
    if value is None:
        return ReplayOptions()
    if not isinstance(value, Mapping):
        raise SpecError(f"{where}: expected a mapping of {sorted(_OPTION_KEYS)}")
    kwargs: dict[str, Any] = {}
    for key, v in value.items():
        k = f"{where}.{key}"
        if key not in _OPTION_KEYS:
            raise SpecError(f"{k}: unknown key; expected one of {sorted(_OPTION_KEYS)}")
        kind = _OPTION_KEYS[key]
        if kind == "bool" and not isinstance(v, bool):
            raise SpecError(f"{k}: expected true or false, got {v!r}")
        if kind == "float":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
                raise SpecError(f"{k}: expected a number in (0, 1), got {v!r}")
            v = float(v)
        if kind == "replicates" and (isinstance(v, bool) or not isinstance(v, int)
                                     or not (v == 0 or 2 <= v <= MAX_BOOTSTRAP)):
            raise SpecError(f"{k}: expected 0 (off) or an integer in [2, {MAX_BOOTSTRAP}] "
                            f"(bootstrap replicates), got {v!r}")
        if kind == "precision" and v not in ("float64", "float32"):
            raise SpecError(f"{k}: expected 'float64' or 'float32', got {v!r}")
        if kind == "list":
            v = _str_list(v, k)
            for i, role in enumerate(v):
                if role not in _ROLES:
                    raise SpecError(f"{k}[{i}]: unknown query role {role!r}; expected one of "
                                    f"{list(_ROLES)}")
        kwargs[key] = v
    return ReplayOptions(**kwargs)
