"""The ``grid`` part of a sweep spec: scores × designs × corrections × budgets × allocators ×
schedules, with per-score / per-design / per-allocator hyperparameters.

The grammar (documented in ``docs/sweeps.md``) is plain YAML data; nothing is executed or
imported. Every list-valued key may also be given as a single value. A hyperparameter given as
a list is swept (Cartesian product); the expansion is deduplicated by :attr:`Policy.id` and
keeps the order of the spec. Configurations that differ only in a score their design ignores
(``bernoulli``; ``mixture: 1``) are computed once (:mod:`tracesim.policies.redundancy`; the
note is listed with the skipped combinations), and token budgets below ``sinks + window`` raise
a :class:`BudgetWarning` naming the effective budget. The grid may also be a list of such
mappings (their union).

>>> [p.id for p in parse_grid({"score": "full"})]
['full']

Other commands (e.g. ``tracesim evict --grid``) reuse :func:`parse_grid`.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

from tracesim.budgets import ALLOCATORS, Budget
from tracesim.counts import DECODE_EVERY, GRID_CONFIGS, GRID_PARTS, SUMMARY_PAGE
from tracesim.designs import DESIGN_REGISTRY, DESIGNS, make_design
from tracesim.policies import CORRECTIONS, SCORE_REGISTRY, SCORES, Policy, make_score
from tracesim.policies.kvpress import budget_from_compression_ratio
from tracesim.policies.redundancy import budget_warnings, merge_score_free
from tracesim.schedules import COORDINATIONS, Schedule

__all__ = ["GRID_KEYS", "BudgetWarning", "GridExpansion", "SpecError", "expand_grid",
           "parse_grid", "parse_schedule"]

#: Keys of a grid mapping -> (required, meaning).
GRID_KEYS: dict[str, tuple[bool, str]] = {
    "score": (True, f"scores, any of {sorted(SCORES)}, a kvpress alias (streaming_llm, "
                    "observed_attention, ...) or an installed plugin's name"),
    "design": (False, f"inclusion designs, any of {sorted(DESIGNS)} (required unless every "
                      "score is 'full')"),
    "correction": (False, "corrections: auto (default), none, hajek"),
    "budget": (False, "budgets: fractions of the context in (0, 1] as floats (0.25, 1.0) or "
                      "token counts as integers >= 1 (512) (required unless every score is "
                      "'full')"),
    "compression_ratio": (False, "kvpress convention, instead of budget: fractions removed in "
                                 "[0, 1); budget = 1 - compression_ratio"),
    "allocator": (False, f"budget allocators, any of {list(ALLOCATORS)} (default uniform)"),
    "schedule": (False, "schedules: oneshot (default), decode (every 16 steps), decode:K"),
    "score_params": (False, "per-score hyperparameters {score: {param: value or [values]}}; "
                            "the key '*' applies to every score that has the parameter"),
    "design_params": (False, "per-design hyperparameters {design: {param: value or [values]}}"),
    "allocator_params": (False, "allocator hyperparameters: adakv: {alpha}, pyramidkv: {beta}"),
    "summary_page": (False, "page sizes (positions, integers >= 1) of the missing-token "
                            "summaries behind the deterministic bound; 0 = none (default)"),
}

_ALLOCATOR_PARAMS = {"uniform": (), "adakv": ("alpha",), "pyramidkv": ("beta",)}

#: Limits checked before anything is expanded (docs/sweeps.md, "Limits"; tracesim.counts).
MAX_GRID = GRID_CONFIGS.hi  # configurations of a whole grid (summed over a grid list)
MAX_LIST = 1_000  # values in one list of a grid
MAX_INT_PARAM = 1 << 20  # integer hyperparameters (window, sinks, ...)
MAX_TOKENS = 2**31 - 1  # token budgets


class SpecError(ValueError):
    """An invalid sweep spec or grid; the message names the file and the key."""


class BudgetWarning(UserWarning):
    """A budget below a score's take-all stratum (sinks + window): only that stratum is kept."""


def _merged(policies: list[Policy], skipped: list[str], where: str) -> GridExpansion:
    """Merge configurations whose design ignores the score; warn on swallowed budgets."""
    kept, notes = merge_score_free(policies)
    for message in budget_warnings(kept):
        warnings.warn(f"{where}: {message}", BudgetWarning, stacklevel=3)
    return GridExpansion(kept, sorted(set(skipped) | set(notes)))


@dataclass(frozen=True)
class GridExpansion:
    """A parsed grid: the policies and the combinations left out as incompatible."""

    policies: list[Policy]
    skipped: list[str]


def _fail(where: str, message: str) -> SpecError:
    return SpecError(f"{where}: {message}")


def _as_list(value: Any, where: str) -> list[Any]:
    items = list(value) if isinstance(value, list) else [value]
    if not items:
        raise _fail(where, "is empty; give at least one value")
    if len(items) > MAX_LIST:
        raise _fail(where, f"has {len(items)} values, expected at most {MAX_LIST}")
    return items


def _names(value: Any, where: str, registry: Any, kind: str) -> list[str]:
    out = []
    for i, name in enumerate(_as_list(value, where)):
        key = f"{where}[{i}]" if isinstance(value, list) else where
        if not isinstance(name, str):
            raise _fail(key, f"{name!r} is not a {kind} name (a string)")
        if name not in registry:
            raise _fail(key, f"unknown {kind} {name!r}; expected one of {sorted(registry)}")
        out.append(name)
    return out


def parse_budget(value: Any, where: str) -> tuple[float, str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(where, f"{value!r} is not a budget; give a fraction in (0, 1] (e.g. 0.25) "
                           "or a token count (an integer >= 1)")
    if isinstance(value, int):
        if value > MAX_TOKENS:
            raise _fail(where, f"{value} tokens is out of range; expected a token count "
                               f"<= {MAX_TOKENS}")
        if value < 1:
            raise _fail(where, f"{value} is not a token budget (an integer >= 1); give "
                               "fractions as floats in (0, 1]")
        return float(value), "tokens"
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise _fail(where, f"{value} is not a fraction in (0, 1] — give token budgets as "
                           "integers >= 1")
    return float(value), "fraction"


def _from_ratio(value: Any, where: str) -> list[float]:
    """kvpress compression ratios -> fraction budgets ``1 - ratio`` (floats in (0, 1])."""
    out = []
    for i, r in enumerate(_as_list(value, where)):
        key = f"{where}[{i}]" if isinstance(value, list) else where
        if isinstance(r, bool) or not isinstance(r, (int, float)):
            raise _fail(key, f"{r!r} is not a compression ratio (a number in [0, 1))")
        try:
            out.append(budget_from_compression_ratio(r))
        except ValueError as exc:
            raise _fail(key, str(exc)) from None
    return out


_SCHEDULE_FORMS = "'oneshot', 'decode', 'decode:K', 'step' or 'step:permanent'"


def parse_schedule(value: Any, where: str) -> Schedule:
    """``oneshot``, ``decode``, ``decode:K`` with K in [1, 2^20], ``step`` or ``step:C`` with C
    a coordination; :class:`SpecError` naming ``where`` otherwise (the one reading of a
    schedule, shared by ``tracesim replay``)."""
    if not isinstance(value, str):
        raise _fail(where, f"{value!r} is not a schedule; expected {_SCHEDULE_FORMS}")
    kind, sep, every = value.partition(":")
    if kind == "step":
        coordination = every if sep else "fresh"
        if coordination not in COORDINATIONS:
            raise _fail(where, f"{value!r}: the coordination of 'step:C' must be one of "
                               f"{COORDINATIONS}")
        return Schedule("step", coordination=coordination)
    if kind not in ("oneshot", "decode") or (sep and kind != "decode"):
        raise _fail(where, f"unknown schedule {value!r}; expected {_SCHEDULE_FORMS}")
    if not sep:
        return Schedule(kind)
    # the digit count first: int() of a 10**6-digit K would itself be slow
    if not every.isdigit() or len(every) > 8 or not 1 <= int(every) <= DECODE_EVERY.hi:
        raise _fail(where, f"{value[:40]!r}: K in 'decode:K' must be an integer >= 1 and <= "
                           f"{DECODE_EVERY.hi} (expected e.g. 'decode:16')")
    return Schedule("decode", int(every))


def _pages(value: Any, where: str) -> list[int]:
    out = []
    for i, v in enumerate(_as_list(value, where)):
        key = f"{where}[{i}]" if isinstance(value, list) else where
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= SUMMARY_PAGE.hi:
            raise _fail(key, f"{v!r} is not a page size; expected an integer in [1, "
                             f"{SUMMARY_PAGE.hi}] (positions per page) or 0 for no summaries")
        out.append(v)
    return out


def _check_type(value: Any, typ: str, where: str) -> Any:
    """Check a hyperparameter value against its dataclass field type (a string)."""
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
    }.get(typ.split("|")[0].strip(), True)
    if not ok:
        raise _fail(where, f"{value!r} has the wrong type; expected {typ}")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT_PARAM:
        raise _fail(where, f"{value} is out of range; expected |value| <= {MAX_INT_PARAM}")
    if isinstance(value, float) and not math.isfinite(value):
        raise _fail(where, f"{value!r} is not finite; expected a finite number")
    return float(value) if typ == "float" else value


def _param_combos(params: Any, allowed: dict[str, str], where: str) -> list[dict[str, Any]]:
    """Expand ``{param: value or [values]}`` into the list of its combinations."""
    if params is None:
        return [{}]
    if not isinstance(params, Mapping):
        raise _fail(where, f"expected a mapping {{param: value}}, got {type(params).__name__}")
    names, options = [], []
    for name, value in params.items():
        key = f"{where}.{name}"
        if name not in allowed:
            raise _fail(key, f"unknown parameter; expected one of {sorted(allowed)}")
        values = _as_list(value, key)
        checked = []
        for i, v in enumerate(values):
            checked.append(_check_type(v, allowed[name],
                                       f"{key}[{i}]" if isinstance(value, list) else key))
        names.append(name)
        options.append(checked)
    if math.prod(len(o) for o in options) > MAX_GRID:
        raise _fail(where, f"has {math.prod(len(o) for o in options)} combinations, expected "
                           f"at most {MAX_GRID}")
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*options)]


def _field_types(cls: type) -> dict[str, str]:
    return {f.name: str(f.type) for f in fields(cls)
            if f.init and (f.default is not MISSING or f.default_factory is not MISSING)}


def _section(grid: Mapping, key: str, names: list[str], registry: Mapping,
             where: str, types: Any) -> dict[str, list[dict[str, Any]]]:
    """Per-name hyperparameter combinations of ``score_params`` / ``design_params``."""
    raw = grid.get(key) or {}
    if not isinstance(raw, Mapping):
        raise _fail(f"{where}.{key}", "expected a mapping {name: {param: value}}")
    for name in raw:
        if name != "*" and name not in registry:
            raise _fail(f"{where}.{key}.{name}", f"unknown name; expected one of "
                                                 f"{sorted(registry)}")
        if name != "*" and name not in names:
            raise _fail(f"{where}.{key}.{name}", f"{name!r} is not in the grid's "
                                                 f"{key.split('_')[0]} list")
    out = {}
    for name in names:
        allowed = types(name)
        merged: dict[str, Any] = {}
        star = raw.get("*") or {}
        if not isinstance(star, Mapping):
            raise _fail(f"{where}.{key}.*", "expected a mapping {param: value}")
        merged.update({k: v for k, v in star.items() if k in allowed})
        unknown = [k for k in star if not any(k in types(n) for n in names)]
        if unknown:
            raise _fail(f"{where}.{key}.*.{unknown[0]}", "no listed name has this parameter")
        own = raw.get(name) or {}
        if not isinstance(own, Mapping):
            raise _fail(f"{where}.{key}.{name}", f"{own!r} is not a mapping; expected "
                                                 "{param: value or [values]}")
        merged.update(own)
        label = f"{where}.{key}.{name}" if name in raw else f"{where}.{key}.*"
        out[name] = _param_combos(merged, allowed, label)
    return out


def _expand_one(grid: Any, where: str, limit: int = MAX_GRID) -> GridExpansion:
    if not isinstance(grid, Mapping):
        raise _fail(where, f"expected a mapping of {sorted(GRID_KEYS)}, got "
                           f"{type(grid).__name__}")
    for key in grid:
        if key not in GRID_KEYS:
            raise _fail(f"{where}.{key}", f"unknown key; expected one of {sorted(GRID_KEYS)}")
    if "score" not in grid:
        raise _fail(f"{where}.score", "missing; list the scores to sweep")
    scores = _names(grid["score"], f"{where}.score", SCORE_REGISTRY, "score")
    evicting = any(SCORE_REGISTRY[s].evicts for s in scores)
    if "compression_ratio" in grid:
        if "budget" in grid:
            raise _fail(f"{where}.compression_ratio", "give either budget or compression_ratio, "
                                                      "not both")
        grid = {**grid, "budget": _from_ratio(grid["compression_ratio"],
                                              f"{where}.compression_ratio")}
    for key in ("design", "budget"):
        if evicting and key not in grid:
            raise _fail(f"{where}.{key}", f"missing; {GRID_KEYS[key][1]}")
    designs = (_names(grid["design"], f"{where}.design", DESIGN_REGISTRY, "design")
               if "design" in grid else ["topk"])
    corrections = _names(grid.get("correction", "auto"), f"{where}.correction",
                         CORRECTIONS + ("auto",), "correction")
    raw_b = grid.get("budget", 1.0)
    budgets = [parse_budget(b, f"{where}.budget[{i}]" if isinstance(raw_b, list) else
                       f"{where}.budget") for i, b in enumerate(_as_list(raw_b,
                                                                         f"{where}.budget"))]
    allocators = _names(grid.get("allocator", "uniform"), f"{where}.allocator",
                        {a: None for a in ALLOCATORS}, "allocator")
    raw_s = grid.get("schedule", "oneshot")
    schedules = [parse_schedule(s, f"{where}.schedule[{i}]" if isinstance(raw_s, list) else
                                f"{where}.schedule")
                 for i, s in enumerate(_as_list(raw_s, f"{where}.schedule"))]
    pages = _pages(grid.get("summary_page", 0), f"{where}.summary_page")
    score_p = _section(grid, "score_params", scores, SCORE_REGISTRY, where,
                       lambda n: {k: t for k, t in _field_types(SCORE_REGISTRY[n]).items()})
    design_p = _section(grid, "design_params", designs, DESIGN_REGISTRY, where,
                        lambda n: _field_types(DESIGN_REGISTRY[n]))
    alloc_types = {"alpha": "float", "beta": "float"}
    alloc_p = _section(grid, "allocator_params", allocators, {a: None for a in ALLOCATORS},
                       where, lambda n: {k: alloc_types[k] for k in _ALLOCATOR_PARAMS[n]})
    # counted before a single Policy is built; ``limit`` is what a grid list has left
    size = (sum(len(score_p[s]) for s in scores) * sum(len(design_p[d]) for d in designs)
            * len(corrections) * len(budgets) * len(schedules) * len(pages)
            * sum(len(alloc_p[a]) for a in allocators))
    if size > limit:
        total = "" if limit == MAX_GRID else f" (with the mappings before it, more than {MAX_GRID})"
        raise _fail(where, f"has {size} combinations{total}, expected at most {MAX_GRID} in "
                           "the whole grid (split the sweep)")
    out: dict[str, Policy] = {}
    skipped: list[str] = []
    for s in scores:
        for sp in score_p[s]:
            try:
                score = make_score(s, **sp)
            except ValueError as exc:
                raise _fail(f"{where}.score_params.{s}", str(exc)) from None
            if not score.evicts:
                out.setdefault("full", Policy(score=score))
                continue
            for dname in designs:
                for dp in design_p[dname]:
                    try:
                        design = make_design(dname, **dp)
                    except ValueError as exc:
                        raise _fail(f"{where}.design_params.{dname}", str(exc)) from None
                    for corr, (value, unit), alloc, sched, page in itertools.product(
                            corrections, budgets, allocators, schedules, pages):
                        for ap in alloc_p[alloc]:
                            try:
                                budget = Budget(value, unit, alloc, **ap)
                            except ValueError as exc:
                                raise _fail(f"{where}.allocator_params.{alloc}",
                                            str(exc)) from None
                            if design.variance == "fixed" and sched.kind != "oneshot":
                                skipped.append(f"{s} x {dname} x {sched.label()}: fixed-size "
                                               "designs support only the oneshot schedule")
                                continue
                            if sched.per_step != score.per_step:
                                # gqa 'head' is named: it is a per-step sample by definition.
                                label = f"{s} (gqa: head)" if score.per_query_head else s
                                skipped.append(f"{label} x {sched.label()}: per-step scores "
                                               "run only under 'step' schedules, and 'step' "
                                               "only with per-step scores")
                                continue
                            try:
                                p = Policy(score=score, design=design, correction=corr,
                                           budget=budget, schedule=sched, summary_page=page)
                            except ValueError as exc:
                                raise _fail(where, str(exc)) from None
                            out.setdefault(p.id, p)
    return GridExpansion(list(out.values()), sorted(set(skipped)))


def expand_grid(grid: Any, where: str = "grid") -> GridExpansion:
    """Validate and expand a grid (a mapping, or a list of mappings whose union is taken).

    Parameters
    ----------
    grid : mapping or list of mappings
        Keys :data:`GRID_KEYS`.
    where : str
        Prefix of error messages (e.g. ``"spec.yaml: grid"``).

    Returns
    -------
    GridExpansion

    Raises
    ------
    SpecError
        Naming the offending key, e.g. ``grid.budget[1]: 1.5 is not a fraction in (0, 1]``.
    """
    if isinstance(grid, list):
        if not grid:
            raise _fail(where, "is empty; give a mapping with at least 'score'")
        GRID_PARTS.check_items(grid, where, SpecError, distinct=False)
        # One budget for the whole list: 200k copies of one mapping are refused at the first
        # copy that goes over, before the rest are expanded.
        parts, left = [], MAX_GRID
        for i, g in enumerate(grid):
            parts.append(_expand_one(g, f"{where}[{i}]", left))
            left -= len(parts[-1].policies) + len(parts[-1].skipped)
        merged: dict[str, Policy] = {}
        for part in parts:
            for p in part.policies:
                merged.setdefault(p.id, p)
        return _merged(list(merged.values()),
                       [s for part in parts for s in part.skipped], where)
    if grid is None or (isinstance(grid, Mapping) and not grid):
        raise _fail(where, "is empty; give at least 'score' (and 'design' and 'budget')")
    expansion = _expand_one(grid, where)
    if expansion.policies:
        expansion = _merged(expansion.policies, expansion.skipped, where)
    if not expansion.policies:
        raise _fail(where, "expands to no configuration (every combination was skipped: "
                           + "; ".join(expansion.skipped) + ")")
    return expansion


def parse_grid(mapping: Any, where: str = "grid") -> list[Policy]:
    """Validate and expand a grid into policies (see :func:`expand_grid`).

    Parameters
    ----------
    mapping : mapping or list of mappings
        The ``grid`` part of a sweep spec (already loaded with ``yaml.safe_load``).
    where : str, default "grid"
        Prefix of error messages.

    Returns
    -------
    list of Policy
        In spec order, deduplicated by id.
    """
    return expand_grid(mapping, where).policies
