"""The walkthrough commands of docs/replay.md, docs/sweeps.md and docs/perstep.md, read from the
Markdown and run as the README's are (``tests/test_readme.py``).

Every fenced ``sh`` block runs, command by command, in an empty directory holding what a run
from the repository root reads: the sample store, the shipped sweep specs and the
pre-registration they name. A block preceded by ``<!-- docs-test: needs-model ... -->`` or
``<!-- docs-test: long-run ... -->`` is only parsed: each ``tracesim`` command by its own
subcommand's parser, and each ``python`` script or module must exist and declare every option
the command gives it, so a renamed or removed option fails here. Output blocks are plain
fences (no language) and are not read.
"""

from __future__ import annotations

import importlib.util
import shlex
import shutil
from pathlib import Path

import pytest

from tests.test_readme import MARKERS, ROOT, blocks, commands, run_documented_command
from tracesim.app.cli import build_parser

DOCS = [ROOT / "docs" / name for name in ("replay.md", "sweeps.md", "perstep.md")]


def _tracesim_argv(argv: list[str]) -> list[str] | None:
    """The ``tracesim`` command of a line, after a ``/usr/bin/time -f ...`` prefix if any."""
    return argv[argv.index("tracesim"):] if "tracesim" in argv else None


def _python_source(argv: list[str]) -> str:
    """The source of the script or module a ``python ...`` command runs."""
    if argv[1] == "-m":
        spec = importlib.util.find_spec(argv[2])
        assert spec is not None and spec.origin, f"no module {argv[2]}"
        return Path(spec.origin).read_text()
    script = ROOT / argv[1]
    assert script.is_file(), f"no script {argv[1]}"
    return script.read_text()


def _check_parses(doc: Path, argv: list[str]) -> None:
    where = f"{doc.relative_to(ROOT)}: {shlex.join(argv)!r}"
    if argv[0] == "python":
        source = _python_source(argv)
        for option in (arg.split("=")[0] for arg in argv[2:] if arg.startswith("--")):
            assert f'"{option}"' in source, f"{where}: {option} is not an option of {argv[1:3]}"
        return
    tracesim = _tracesim_argv(argv)
    assert tracesim is not None, f"{where}: neither a tracesim nor a python command"
    try:
        build_parser(tracesim[1]).parse_args(tracesim[1:])
    except SystemExit as exc:
        pytest.fail(f"{where} does not parse (exit {exc.code})")


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_markers_are_known(doc):
    found = [line for line in doc.read_text().splitlines() if line.startswith("<!-- docs-test:")]
    assert all(line.startswith(MARKERS) for line in found), found


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_marked_commands_parse(doc):
    marked = [body for lang, body, is_marked in blocks(doc) if lang == "sh" and is_marked]
    for body in marked:
        for argv in commands(body):
            _check_parses(doc, argv)


def test_a_renamed_option_fails_the_parse_check():
    doc = DOCS[0]
    with pytest.raises(pytest.fail.Exception):
        _check_parses(doc, ["tracesim", "replay", "STORE", "--seed", "3"])
    with pytest.raises(AssertionError, match="--rounds"):
        _check_parses(doc, ["python", "benchmarks/bench_long_costs.py", "--rounds", "3"])


def _empty_directory(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "sample-traces").symlink_to(ROOT / "data" / "sample-traces")
    # copied, not linked: a spec's relative paths resolve against the spec file's own folder
    shutil.copytree(ROOT / "data" / "sweeps", data / "sweeps")
    shutil.copy(ROOT / "data" / "prereg.yaml", data / "prereg.yaml")


@pytest.mark.parametrize("doc", [d for d in DOCS if d.name != "perstep.md"], ids=lambda d: d.name)
def test_walkthrough_runs_in_an_empty_directory(doc, tmp_path, monkeypatch, capsys):
    _empty_directory(tmp_path)
    monkeypatch.chdir(tmp_path)
    ran = 0
    for lang, body, marked in blocks(doc):
        if lang != "sh" or marked:
            continue
        for argv in commands(body):
            run_documented_command(doc.name, argv, capsys)
            ran += 1
    assert ran >= 1


def test_perstep_walkthrough_is_all_marked():
    # every per-step command captures SmolLM2 traces or runs for minutes: all are parsed only
    found = [marked for lang, _, marked in blocks(DOCS[2]) if lang == "sh"]
    assert found and all(found)


def test_shipped_specs_write_into_the_checkouts_ignored_results(tmp_path, monkeypatch):
    # docs/sweeps.md: a spec's relative paths resolve against its own folder, whatever the
    # working directory (a rerun from anywhere resumes the same sweep), and the shipped specs
    # write under the checkout's results/, which git ignores; --out is relative to the cwd
    from tracesim.safeio import read_yaml
    from tracesim.sweep.spec import load_spec

    assert "/results/" in (ROOT / ".gitignore").read_text().split()
    for spec in sorted((ROOT / "data" / "sweeps").glob("*.yaml")):
        output = read_yaml(spec).get("output")
        assert output is None or str(output).startswith("../../results/"), (spec.name, output)
    monkeypatch.chdir(tmp_path)
    example = ROOT / "data" / "sweeps" / "example.yaml"
    assert load_spec(example).output == ROOT / "results" / "sweeps" / "example"
    assert load_spec(example, output="mine").output == tmp_path.resolve() / "mine"
