"""The ``tracesim`` command line.

Each subcommand lives in the module that owns it and exposes ``register(subparsers)``, which adds
its parser and sets ``func`` to a callable taking the parsed namespace and returning an exit code.

Adding a subcommand is one line in :data:`_SUBCOMMAND_MODULES` (the module). A module is
imported only when its subcommand is chosen (``tracesim NAME ...``, ``tracesim NAME --help``),
provided :data:`_COMMANDS` gives its subcommand name and help line: ``tracesim --help`` then
lists it from that table alone and imports nothing heavy. A module without a ``_COMMANDS`` line
still works, but is imported by every invocation. Modules listed here must not import torch at
import time, and each help line should match the one its module registers (``tests/test_cli.py``
checks both).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tracesim.cli_help import Parser

# Modules whose ``register`` adds a subcommand, in ``tracesim --help`` order.
_SUBCOMMAND_MODULES: tuple[str, ...] = (
    "tracesim.capture.cli",
    "tracesim.store.cli",
    "tracesim.replay.cli",
    "tracesim.sweep.cli",
    "tracesim.adversary",
    "tracesim.capture.inloop.evict_cli",
    "tracesim.analysis.cli",
    "tracesim.analysis.frontier_cli",
    "tracesim.app.demo",
    "tracesim.synth.cli",
    "tracesim.export",
    "tracesim.tiers.cli",
    "tracesim.peers.cli",
)

# module -> (subcommand, help line of ``tracesim --help``): these modules load lazily.
_COMMANDS: dict[str, tuple[str, str]] = {
    "tracesim.capture.cli": ("capture", "record attention traces of a model on generated "
                             "long-context tasks"),
    "tracesim.store.cli": ("validate", "check a trace store (schema, shapes, checksums, "
                           "NaN/Inf, boundaries)"),
    "tracesim.replay.cli": ("replay", "replay eviction policies over a trace store (Parquet "
                            "results)"),
    "tracesim.sweep.cli": ("sweep", "run a declarative sweep (YAML spec) locally or on Dask; "
                           "resumable"),
    "tracesim.adversary": ("adversary", "claim C0: perturb evicted values; top-k cannot see it"),
    "tracesim.capture.inloop.evict_cli": ("evict", "run eviction policies inside the model and "
                                          "record end-to-end outcomes"),
    "tracesim.analysis.cli": ("report", "evaluate the pre-registered claims; write the report "
                              "(Markdown + standalone HTML)"),
    "tracesim.app.demo": ("demo", "the main job: capture -> sweep -> evict -> report"),
    "tracesim.synth.cli": ("synth", "write a synthetic trace store (sinks, local window, heavy "
                           "hitters, retrieval heads)"),
    "tracesim.export": ("export", "export results as CSV or a hive-partitioned Parquet dataset"),
    "tracesim.tiers.cli": ("tiers", "simulate certificate-scheduled fetches from DRAM/NVMe "
                           "tiers"),
    "tracesim.peers.cli": ("peers", "replay MagicPIG, vAttention and Quest as their reference "
                           "code defines them (Parquet results)"),
    "tracesim.analysis.frontier_cli": ("frontier", "coverage / certified share / error / memory "
                                       "frontier per policy and certificate variant "
                                       "(frontier.parquet, .md, .png)"),
}


def _version() -> str:
    from tracesim.version import __version__

    return __version__


def _chosen(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (the first argument that is not an option)."""
    for arg in argv:
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return arg
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Top-level parser; imports ``command``'s module (every module if ``"*"``) and the modules
    without a :data:`_COMMANDS` line; the others are listed with their table help line."""
    parser = Parser(
        prog="tracesim",
        description="Simulation and statistics over recorded attention traces. Each "
        "subcommand has its own --help with an example; docs/cli.md collects them all.",
        epilog="example (capture -> sweep -> evict -> report on the default model):\n"
        "  tracesim demo --out demo/",
    )
    parser.add_argument("--version", action="version", version=f"tracesim {_version()}")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of any error")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _SUBCOMMAND_MODULES:
        entry = _COMMANDS.get(module_name)
        if entry is not None and command not in (entry[0], "*"):
            subparsers.add_parser(entry[0], help=entry[1], add_help=False)
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # A missing optional module only hides its subcommand; a broken one surfaces.
            if exc.name is None or not module_name.startswith(exc.name):
                raise
            if entry is not None and command == entry[0]:
                parser.error(f"subcommand {entry[0]!r} is not available: module {exc.name!r} "
                             "is not installed")
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tracesim`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_chosen(argv))
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    if args.debug:
        return int(args.func(args) or 0)
    return _run_clean(args)


def _run_clean(args: argparse.Namespace) -> int:
    """Run the subcommand; user errors exit 2 with one line, never a traceback."""
    from tracesim.errors import describe_os_error

    prog = f"tracesim {args.command}"
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except ValueError as exc:  # UsageError, StoreError, SpecError and invalid parameters
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # disk full, permissions, missing files
        print(f"{prog}: {describe_os_error(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug: one line, the traceback behind --debug
        print(f"{prog}: internal error {type(exc).__name__}: {exc} (rerun with "
              "'tracesim --debug ...' for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
