"""The README's commands, read from the Markdown itself and run top to bottom.

Every fenced ``sh`` block runs, command by command, in an empty directory holding only the
sample store at ``data/sample-traces`` (the README says to run them from the repository root;
the store is the one input). A block preceded by ``<!-- docs-test: needs-model ... -->``
needs the model (``<!-- docs-test: long-run ... -->``: a run of minutes): each of its
``tracesim`` commands is still parsed by its own subcommand's parser, so a renamed or removed
option fails here. Every ``python`` block runs too.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from tracesim.app.cli import build_parser
from tracesim.app.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKERS = ("<!-- docs-test: needs-model", "<!-- docs-test: long-run")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def blocks(path: Path) -> list[tuple[str, str, bool]]:
    """``(language, body, needs_model)`` of every fenced block, in order."""
    text = path.read_text()
    out = []
    for match in _FENCE.finditer(text):
        before = text[:match.start()].rstrip().splitlines()
        marked = bool(before) and before[-1].startswith(MARKERS)
        out.append((match.group(1), match.group(2), marked))
    return out


def commands(body: str) -> list[list[str]]:
    """The shell commands of a block: continuations joined, comments dropped."""
    joined = body.replace("\\\n", " ")
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def run_documented_command(where: str, argv: list[str], capsys) -> None:
    """Run one ``tracesim`` command of a doc's block; it must exit 0 and print what the docs
    say its summary shows (the proxy's deployability mark, the dry run's grid line)."""
    assert argv[0] == "tracesim", f"{where}: {argv[0]!r} is not a tracesim command"
    code = cli_main(argv[1:])
    captured = capsys.readouterr()
    assert code == 0, f"{where}: {shlex.join(argv)} exited {code}: {captured.err}"
    if "--proxy" in argv:
        assert "quant:4 (deployable)" in captured.out
    if any('"exact"' in arg for arg in argv):
        assert "exact (not deployable)" in captured.out
    if "--dry-run" in argv:  # the docs' figures are the dry run's (checked below)
        assert re.search(r"grid: \d+ configuration", captured.out)


def test_the_readme_has_runnable_and_marked_blocks():
    found = blocks(README)
    assert any(lang == "sh" and not marked for lang, _, marked in found)
    assert any(lang == "sh" and marked for lang, _, marked in found)
    assert any(lang == "python" for lang, _, _ in found)


def test_marked_commands_parse():
    for lang, body, marked in blocks(README):
        if lang != "sh" or not marked:
            continue
        for argv in commands(body):
            if argv[0] != "tracesim":
                assert argv[0] == "make", argv  # the set-up block
                continue
            try:
                build_parser(argv[1]).parse_args(argv[1:])
            except SystemExit as exc:
                pytest.fail(f"README: {shlex.join(argv)!r} does not parse (exit {exc.code})")


def test_readme_runs_top_to_bottom_in_an_empty_directory(tmp_path, monkeypatch, capsys):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sample-traces").symlink_to(ROOT / "data" / "sample-traces")
    monkeypatch.chdir(tmp_path)
    ran = 0
    for lang, body, marked in blocks(README):
        if marked:
            continue
        if lang == "sh":
            for argv in commands(body):
                run_documented_command("README", argv, capsys)
                ran += 1
        elif lang == "python":
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(body, "README.md", "exec"), {"__name__": "readme"})  # noqa: S102
            printed = out.getvalue()
            # what the README's comment promises the summary shows
            for word in ("estimate", "certificate", "tail size", "n_eff", "full matrix"):
                assert word in printed, word
            ran += 1
    assert ran >= 5


def test_replay_doc_python_snippet_runs_on_the_sample_store(tmp_path, monkeypatch, capsys):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sample-traces").symlink_to(ROOT / "data" / "sample-traces")
    monkeypatch.chdir(tmp_path)
    snippets = [body for lang, body, _ in blocks(ROOT / "docs" / "replay.md") if lang == "python"]
    assert snippets
    for body in snippets:
        exec(compile(body, "docs/replay.md", "exec"), {"__name__": "replay_doc"})  # noqa: S102
    assert "snapkv" in capsys.readouterr().out


def test_sweeps_doc_figures_are_the_dry_runs():
    # docs/sweeps.md's sample-store figures come from `tracesim sweep data/sweeps/example.yaml
    # --dry-run` (the command the doc shows); the doc fails here when they drift
    from tracesim.sweep.dryrun import describe
    from tracesim.sweep.spec import load_spec

    text = describe(load_spec(ROOT / "data" / "sweeps" / "example.yaml"), calibrate_time=False)
    n_configs = re.search(r"grid: (\d+) configuration", text).group(1)
    rows = re.search(r"(\d+) result rows", text).group(1)
    doc = (ROOT / "docs" / "sweeps.md").read_text()
    assert f"grid: {n_configs} configuration(s)" in doc, n_configs
    assert f"{rows} result rows" in doc and f"True, {rows}," in doc, rows
