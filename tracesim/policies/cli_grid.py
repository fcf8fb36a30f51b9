"""Command-line options that reach every score and design: ``--proxy``, ``--gqa``,
``--score-params`` and ``--design-params``, read with the sweep spec's grid grammar.

``tracesim replay`` (and any command that builds a grid from options) turns its options into a
``grid`` mapping and expands it with :func:`tracesim.policies.grid.expand_grid`, the parser of
sweep specs: ``--score-params '{"perstep": {"proxy": ["quant:4", "exact"]}}'`` means exactly
what ``grid: {score_params: {perstep: {proxy: [quant:4, exact]}}}`` means in a spec (a list is
swept, ``*`` applies to every listed score that has the parameter). Errors name the option.
"""

from __future__ import annotations

import argparse
import re
import warnings
from typing import Any

from tracesim.errors import UsageError

__all__ = ["add_design_options", "grid_from_options", "overlay_options",
           "policies_from_options", "proxy_label"]

#: Grid keys -> the option that sets them (error messages name the option, not the grid key).
_OPTION_OF = {"score_params": "--score-params", "design_params": "--design-params",
              "budget": "--budget", "score": "--score", "design": "--design",
              "schedule": "--schedule", "correction": "--correction",
              "allocator": "--allocator", "summary_page": "--summary-page"}


def add_design_options(p: argparse.ArgumentParser) -> None:
    """Add ``--proxy``, ``--gqa``, ``--score-params`` and ``--design-params``."""
    from tracesim.policies.perstep import GQA_AGGREGATIONS

    p.add_argument("--proxy", default=None, metavar="SPEC",
                   help="proxy of the per-step score (score perstep): exact (a reference, not "
                   "deployable), quant:b, lowrank:r, pages:P or simhash:K,L (docs/perstep.md; "
                   "default exact, printed)")
    p.add_argument("--gqa", default=None, choices=GQA_AGGREGATIONS,
                   help="per-step score: one sample per KV head from the group's mean "
                   "(default) or max proxy attention, or one per query head (head)")
    p.add_argument("--score-params", default=None, metavar="JSON",
                   help="any score's parameters, as a sweep spec's grid.score_params: "
                   "'{\"perstep\": {\"proxy\": \"quant:4\", \"top_fraction\": 0.5}}'; a list "
                   "is swept, the key \"*\" applies to every listed score that has the "
                   "parameter (docs/sweeps.md; default: each score's own; in evict, laid "
                   "over the grid file's)")
    p.add_argument("--design-params", default=None, metavar="JSON",
                   help="any design's parameters, as a sweep spec's grid.design_params: "
                   "'{\"poisson\": {\"mixture\": 0.1}}' (docs/sweeps.md; default: each "
                   "design's own; in evict, laid over the grid file's)")


def _json_mapping(text: str | None, option: str) -> dict[str, Any]:
    from tracesim.safeio import loads_json

    if text is None:
        return {}
    doc = loads_json(text, option)
    if not isinstance(doc, dict) or not all(isinstance(v, dict) for v in doc.values()):
        raise UsageError(f"{option}: expected a JSON mapping {{name: {{parameter: value}}}}, "
                         f"got {text!r}")
    return doc


def _put(section: dict[str, dict[str, Any]], name: str, param: str, value: Any,
         option: str, json_option: str) -> None:
    own = section.setdefault(name, {})
    if param in own and own[param] != value:
        raise UsageError(f"{option} {value!r}: {json_option} also sets {name}.{param} = "
                         f"{own[param]!r}; give it once")
    own[param] = value


def grid_from_options(args: argparse.Namespace) -> dict[str, Any]:
    """The sweep-spec ``grid`` mapping the options describe (``args`` as ``tracesim replay``
    parses them: score, design, budget, correction, allocator, schedule, summary_page, window,
    mixture, floor, proxy, gqa, score_params, design_params)."""
    from tracesim.proxies import make_proxy

    score_params = _json_mapping(args.score_params, "--score-params")
    design_params = _json_mapping(args.design_params, "--design-params")
    if args.proxy is not None:
        try:
            make_proxy(args.proxy)
        except ValueError as exc:
            raise UsageError(f"--proxy: {exc}") from None
    for option, param, value in (("--proxy", "proxy", args.proxy), ("--gqa", "gqa", args.gqa)):
        if value is None:
            continue
        if "perstep" not in args.score:
            raise UsageError(f"{option} {value}: applies to the per-step score, and 'perstep' "
                             f"is not in --score {','.join(args.score)}")
        _put(score_params, "perstep", param, value, option, "--score-params")
    if getattr(args, "window", None) is not None:
        _put(score_params, "*", "window", args.window, "--window", "--score-params")
    for option, param in (("--mixture", "mixture"), ("--floor", "floor")):
        value = getattr(args, param, None)
        if value is None:
            continue
        for design in ("poisson", "fixed"):
            if design in args.design:
                _put(design_params, design, param, value, option, "--design-params")
    grid: dict[str, Any] = {
        "score": list(args.score), "design": list(args.design),
        "correction": args.correction, "allocator": args.allocator,
        "schedule": args.schedule,
        "budget": [int(v) if unit == "tokens" else float(v) for v, unit in args.budget],
        "summary_page": list(args.summary_page)}
    if score_params:
        grid["score_params"] = score_params
    if design_params:
        grid["design_params"] = design_params
    return grid


def _names_of(mapping: dict[str, Any], key: str) -> list[str]:
    value = mapping.get(key, [])
    return [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]


def overlay_options(grid: Any, args: argparse.Namespace) -> Any:
    """A grid file's ``grid`` (a mapping or a list of them) with ``--proxy``, ``--gqa``,
    ``--score-params`` and ``--design-params`` laid over it: each named score's (design's)
    parameters are set in every mapping that lists it, the option winning over the file. A name
    no mapping lists is refused, naming the option."""
    score_params = _json_mapping(args.score_params, "--score-params")
    design_params = _json_mapping(args.design_params, "--design-params")
    for option, param, value in (("--proxy", "proxy", args.proxy), ("--gqa", "gqa", args.gqa)):
        if value is not None:
            _put(score_params, "perstep", param, value, option, "--score-params")
    if not score_params and not design_params:
        return grid
    parts = [dict(g) if isinstance(g, dict) else g for g in
             (grid if isinstance(grid, list) else [grid])]
    for option, key, listed, section in (
            ("--score-params", "score_params", "score", score_params),
            ("--design-params", "design_params", "design", design_params)):
        for name, params in section.items():
            hit = False
            for part in parts:
                if not isinstance(part, dict) or (name != "*" and name not in
                                                  _names_of(part, listed)):
                    continue
                own = dict(part.get(key) or {})
                own[name] = {**dict(own.get(name) or {}), **params}
                part[key] = own
                hit = True
            if not hit:
                shown = "--proxy/--gqa" if option == "--score-params" and name == "perstep" \
                    and (args.proxy or args.gqa) else option
                known = sorted({n for p in parts if isinstance(p, dict)
                                for n in _names_of(p, listed)})
                raise UsageError(f"{shown}: {name!r} is not a {listed} of the grid, which "
                                 f"lists {known}")
    return parts if isinstance(grid, list) else parts[0]


def _option_message(message: str) -> str:
    """``grid.score_params.perstep.proxy: ...`` -> ``--score-params: perstep.proxy: ...``;
    ``grid.budget[1]: ...`` -> ``--budget[1]: ...``; ``grid: ...`` -> ``options: ...``."""
    match = re.match(r"grid\.([a-z_]+)(\[\d+\])?(?:\.([^:]*))?: (.*)", message, re.S)
    if match is None or match.group(1) not in _OPTION_OF:
        return "options" + message.removeprefix("grid") if message.startswith("grid:") \
            else message
    key, index, path, text = match.groups()
    return f"{_OPTION_OF[key]}{index or ''}: {path + ': ' if path else ''}{text}"


def policies_from_options(args: argparse.Namespace) -> tuple[list, list[str]]:
    """Expand the options' grid with the sweep spec's parser: (policies, notes on combinations
    merged or left out). Raises :class:`UsageError` naming the option."""
    from tracesim.policies.grid import BudgetWarning, SpecError, expand_grid

    grid = grid_from_options(args)
    try:
        with warnings.catch_warnings():  # the command prints its own, with the store's lengths
            warnings.simplefilter("ignore", BudgetWarning)
            expansion = expand_grid(grid, "grid")
    except SpecError as exc:
        raise UsageError(_option_message(str(exc))) from None
    return expansion.policies, expansion.skipped


def proxy_label(score: Any) -> str:
    """``quant:4 (deployable)`` / ``exact (not deployable)`` for a per-step score, ``""`` for
    a score without a proxy; a score that reads the future (``oracle``) is marked too."""
    proxy = getattr(score, "proxy", None)
    if proxy is None:
        return "" if getattr(score, "deployable", True) else "(not deployable)"
    state = "deployable" if score.deployable else "not deployable"
    gqa = getattr(score, "gqa", "mean")
    return f"{proxy} (gqa {gqa}, {state})" if gqa != "mean" else f"{proxy} ({state})"
