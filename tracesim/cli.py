"""The ``tracesim`` command line.

Each subcommand lives in the module that owns it and exposes ``register(subparsers)``, which adds
its parser and sets ``func`` to a callable taking the parsed namespace and returning an exit code.

Adding a subcommand is one line in :data:`SUBCOMMANDS`: ``(name, module, one-line help)``. The
module is imported only when its subcommand is chosen (``tracesim NAME ...`` or
``tracesim NAME --help``); ``tracesim --help`` lists the names and help lines from the table alone,
so it imports nothing heavy. Modules listed here must not import torch at import time, and the
help line should match the one the module registers (``tests/test_cli.py`` checks both).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (subcommand, module whose ``register`` adds it, help line shown by ``tracesim --help``)
SUBCOMMANDS: tuple[tuple[str, str, str], ...] = (
    ("capture", "capture.cli", "record attention traces of a model on generated long-context "
     "tasks"),
    ("validate", "tracesim.store.cli", "check a trace store (schema, shapes, checksums, NaN/Inf, "
     "boundaries)"),
    ("replay", "tracesim.replay.cli", "replay eviction policies over a trace store (Parquet "
     "results)"),
    ("sweep", "tracesim.sweep.cli", "run a declarative sweep (YAML spec) locally or on Dask; "
     "resumable"),
    ("adversary", "tracesim.adversary", "claim C0: perturb evicted values; top-k cannot see it"),
    ("evict", "capture.evict_run", "run eviction policies inside the model and record "
     "end-to-end outcomes"),
    ("report", "analysis.cli", "evaluate the pre-registered claims; write the report (Markdown "
     "+ standalone HTML)"),
    ("demo", "tracesim.demo", "the main job: capture -> sweep -> evict -> report"),
    ("synth", "tracesim.synth.cli", "write a synthetic trace store (sinks, local window, heavy "
     "hitters, retrieval heads)"),
)


def _version() -> str:
    from tracesim import __version__

    return __version__


def _chosen(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (the first argument that is not an option)."""
    names = {name for name, _, _ in SUBCOMMANDS}
    for arg in argv:
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return arg if arg in names else None
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Top-level parser; only ``command``'s module is imported (all of them if ``"*"``).

    The other subcommands are listed with the help line of :data:`SUBCOMMANDS`.
    """
    parser = argparse.ArgumentParser(
        prog="tracesim",
        description="Simulation and statistics over recorded attention traces.",
    )
    parser.add_argument("--version", action="version", version=f"tracesim {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name, help_line in SUBCOMMANDS:
        if command in (name, "*"):
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                # A missing optional module only disables its subcommand; a broken one surfaces.
                if exc.name is None or not module_name.startswith(exc.name):
                    raise
                if command == "*":
                    continue
                parser.error(f"subcommand {name!r} is not available: module {exc.name!r} is "
                             "not installed")
            module.register(subparsers)
        else:
            subparsers.add_parser(name, help=help_line, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tracesim`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_chosen(argv))
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
