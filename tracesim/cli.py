"""The ``tracesim`` command line.

Each subcommand lives in the module that owns it and exposes ``register(subparsers)``, which adds
its parser and sets ``func`` to a callable taking the parsed namespace and returning an exit code.
Modules listed here must not import torch at import time: ``tracesim --help`` works without it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, description) pairs; the module's ``register`` adds the subcommand.
_SUBCOMMAND_MODULES: tuple[str, ...] = (
    "capture.cli",
    "tracesim.store.cli",
    "tracesim.replay.cli",
    "tracesim.sweep.cli",
    "tracesim.adversary",
    "capture.evict_run",
    "analysis.cli",
    "analysis.frontier_cli",
    "tracesim.demo",
)


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every available subcommand."""
    from tracesim import __version__

    parser = argparse.ArgumentParser(
        prog="tracesim",
        description="Simulation and statistics over recorded attention traces.",
    )
    parser.add_argument("--version", action="version", version=f"tracesim {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # A missing optional module only hides its subcommands; a broken one must surface.
            if exc.name is not None and module_name.startswith(exc.name):
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tracesim`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
