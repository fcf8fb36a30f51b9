"""Help that teaches: the shared help formatter, a parser lint, and ``docs/cli.md``.

Every subcommand parser is built with :class:`HelpFormatter` (``tracesim.cli`` passes it to the
subparsers): descriptions and epilogs are wrapped paragraph by paragraph while indented lines
(examples) are kept verbatim, and an option with a default gets ``(default: ...)`` appended
unless its help already mentions its default.

:func:`help_problems` walks the parser and lists options without help text or whose default is
not shown; the test suite fails on any. ``docs/cli.md`` holds the ``--help`` of ``tracesim`` and
of every subcommand as printed at a fixed width; regenerate it with::

    python -m tracesim.cli_docs            # writes docs/cli.md
    python -m tracesim.cli_docs --check    # exit 1 if docs/cli.md is out of date
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

__all__ = ["COLUMNS", "HelpFormatter", "Parser", "help_problems", "iter_parsers",
           "render_markdown"]

#: Terminal width used for ``docs/cli.md`` (argparse reads ``COLUMNS``).
COLUMNS = 100
DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
REGENERATE = "python -m tracesim.cli_docs"


def _format_default(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(_format_default(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _shows_default(action: argparse.Action) -> bool:
    """Whether an option has a default that must be visible in its help."""
    if isinstance(action, (argparse._HelpAction, argparse._VersionAction,
                           argparse._StoreTrueAction, argparse._StoreFalseAction,
                           argparse._StoreConstAction, argparse._CountAction,
                           argparse._SubParsersAction)):
        return False
    if action.required or (not action.option_strings and action.nargs is None):
        return False  # required options and positionals have no default to show
    return True


class HelpFormatter(argparse.HelpFormatter):
    """Wrap description/epilog paragraphs, keep indented lines, append defaults to options."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        for block in re.split(r"\n\s*\n", text.strip("\n")):
            lines = block.split("\n")
            if any(line.startswith(" ") for line in lines):
                out.append("\n".join(indent + line for line in lines))
            else:
                out.append(textwrap.fill(" ".join(line.strip() for line in lines), width,
                                         initial_indent=indent, subsequent_indent=indent))
        return "\n\n".join(out)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (_shows_default(action) and action.default is not None
                and action.default is not argparse.SUPPRESS and "default" not in text.lower()):
            shown = _format_default(action.default).replace("%", "%%")
            text = f"{text} (default: {shown})"
        return text


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose default formatter is :class:`HelpFormatter`; its
    subparsers (``add_subparsers``) are of the same class, so every subcommand gets it."""

    def __init__(self, *args, formatter_class: type = HelpFormatter, **kwargs) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def iter_parsers(parser: argparse.ArgumentParser,
                 prefix: str = "") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``(command, parser)`` for the parser and every subcommand below it, depth first."""
    name = prefix or parser.prog
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from iter_parsers(sub, f"{name} {sub_name}")


def help_problems(parser: argparse.ArgumentParser) -> list[str]:
    """Options without help text, subcommands without a description or an example, and
    options whose default (or what happens without them) the help does not say."""
    problems = []
    for command, p in iter_parsers(parser, "tracesim"):
        if command != "tracesim":
            if not p.description:
                problems.append(f"{command}: no description")
            if not p.epilog or "example" not in p.epilog.lower():
                problems.append(f"{command}: no example (epilog starting 'example:')")
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction,
                                   argparse._SubParsersAction)):
                continue
            label = f"{command} {'/'.join(action.option_strings) or action.dest}"
            if not action.help or action.help is argparse.SUPPRESS:
                problems.append(f"{label}: no help text")
                continue
            if _shows_default(action):
                shown = HelpFormatter(command)._get_help_string(action)
                if "default" not in shown.lower():
                    problems.append(f"{label}: the help does not say the default (or what "
                                    "happens when the option is not given)")
    return problems


@contextlib.contextmanager
def _columns(width: int) -> Iterator[None]:
    """Fixed terminal width, and no colour (Python >= 3.14 may colour help text)."""
    saved = {k: os.environ.get(k) for k in ("COLUMNS", "NO_COLOR", "FORCE_COLOR")}
    os.environ["COLUMNS"] = str(width)
    os.environ["NO_COLOR"] = "1"
    os.environ.pop("FORCE_COLOR", None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def render_markdown(width: int = COLUMNS) -> str:
    """``docs/cli.md``: the ``--help`` of ``tracesim`` and of every subcommand, as printed."""
    from tracesim.cli import build_parser

    with _columns(width):
        parser = build_parser("*")
        parsers = list(iter_parsers(parser, "tracesim"))
        helps = [(command, p.format_help()) for command, p in parsers]
    lines = ["# Command-line reference", "",
             f"<!-- Generated by `{REGENERATE}` at COLUMNS={width}; do not edit by hand. -->",
             "",
             "The `--help` of `tracesim` and of every subcommand, exactly as printed. Options "
             "are also described, with background, in the page each subcommand names.", ""]
    lines += [f"- [`{c}`](#{c.replace(' ', '-')})" for c, _ in helps[1:]]
    lines.append("")
    for command, text in helps:
        lines += [f"## {command}", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Write ``docs/cli.md`` (or, with ``--check``, exit 1 when it is out of date)."""
    ap = argparse.ArgumentParser(prog="python -m tracesim.cli_docs",
                                 description="Generate docs/cli.md from the parsers.")
    ap.add_argument("--check", action="store_true",
                    help="compare instead of writing; exit 1 if docs/cli.md is out of date")
    ap.add_argument("--out", type=Path, default=DOC_PATH,
                    help="file to write (default: docs/cli.md of this checkout)")
    args = ap.parse_args(argv)
    text = render_markdown()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else ""
        if current != text:
            print(f"{args.out} is out of date; regenerate it with `{REGENERATE}`",
                  file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
