"""Help that teaches: every option documented with its default; docs/cli.md up to date."""

from __future__ import annotations

import argparse

from tracesim.app.cli import build_parser
from tracesim.app.cli_docs import DOC_PATH, REGENERATE, render_markdown
from tracesim.cli_help import HelpFormatter, help_problems, iter_parsers


def test_every_subcommand_and_option_is_documented():
    parser = build_parser("*")
    commands = [c for c, _ in iter_parsers(parser, "tracesim")]
    for name in ("capture", "validate", "replay", "sweep", "adversary", "evict", "report",
                 "demo", "export"):
        assert f"tracesim {name}" in commands
    problems = help_problems(parser)
    assert problems == [], "\n".join(problems)


def test_the_lint_catches_missing_help_and_hidden_defaults():
    p = argparse.ArgumentParser(prog="x", formatter_class=HelpFormatter)
    sub = p.add_subparsers()
    s = sub.add_parser("bad", formatter_class=HelpFormatter)
    s.add_argument("--a", type=int, default=3)  # no help
    s.add_argument("--b", default=None, help="something")  # None default not explained
    s.add_argument("--c", type=float, default=0.5, help="a fraction")  # shown automatically
    s.add_argument("--d", action="store_true", help="a flag")
    problems = help_problems(p)
    assert "tracesim bad: no description" in problems
    assert any("--a: no help text" in x for x in problems)
    assert any("--b: the help does not say the default" in x for x in problems)
    assert not any("--c" in x or "--d" in x for x in problems)
    assert "a fraction (default: 0.5)" in s.format_help()


def test_formatter_wraps_paragraphs_and_keeps_examples():
    p = argparse.ArgumentParser(prog="x", formatter_class=HelpFormatter,
                                description="word " * 40 + "\n\nsecond paragraph",
                                epilog="example:\n  x --a 1 --b " + "long " * 30)
    p.add_argument("--list", default=["a", "b"], help="items")
    text = p.format_help()
    assert "  x --a 1 --b " + "long " * 29 + "long" in text  # the example is not wrapped
    assert "\n\nsecond paragraph" in text
    assert "items (default: a,b)" in text


def test_docs_cli_md_is_up_to_date():
    current = DOC_PATH.read_text(encoding="utf-8") if DOC_PATH.is_file() else ""
    assert current == render_markdown(), (
        f"docs/cli.md is out of date with the parsers; regenerate it with `{REGENERATE}`")
