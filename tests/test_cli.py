"""The ``tracesim`` command table: lazy subcommands, light ``--help`` and ``import tracesim``."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tracesim
from tracesim.app.cli import _COMMANDS, _SUBCOMMAND_MODULES, build_parser, main


def test_every_table_entry_registers_its_subcommand_with_the_same_help():
    parser = build_parser("*")
    action = next(a for a in parser._actions if a.dest == "command")
    helps = {c.dest: c.help for c in action._choices_actions}
    assert set(_COMMANDS) <= set(_SUBCOMMAND_MODULES)
    for name, help_line in _COMMANDS.values():
        assert name in action.choices
        assert helps[name] == help_line, name
        assert action.choices[name].get_default("func") is not None, name


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\n"
                          "print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("code", [
    "import tracesim",
    "from tracesim.app.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
])
def test_help_and_import_load_nothing_heavy(code):
    loaded = _modules_after(code)
    heavy = loaded & {"numba", "scipy", "torch", "pyarrow", "pandas", "statsmodels"}
    # A subcommand module without a line in tracesim.app.cli._COMMANDS is imported by --help.
    assert not heavy, f"{sorted(heavy)} imported; modules without a _COMMANDS line: " + str(
        [m for m in _SUBCOMMAND_MODULES if m not in _COMMANDS])


def test_subcommand_help_imports_only_its_module(capsys):
    loaded = _modules_after(
        "from tracesim.app.cli import main\ntry:\n    main(['synth', '--help'])\n"
        "except SystemExit:\n    pass")
    assert "tracesim.synth.cli" in loaded
    assert not loaded & {"tracesim.replay.cli", "tracesim.sweep.cli", "torch", "numba"}
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--help"])
    assert exc.value.code == 0
    assert "--budget" in capsys.readouterr().out


def test_public_names_resolve_lazily():
    for name in tracesim.__all__:
        assert getattr(tracesim, name) is not None
    assert sorted(tracesim._LAZY) == sorted(n for n in tracesim.__all__ if n != "__version__")
    with pytest.raises(AttributeError):
        tracesim.no_such_name  # noqa: B018
    assert main([]) == 2


def test_version_is_one_string():
    """tracesim.version and pyproject.toml carry the same version (read without importing it)."""
    import re
    from pathlib import Path

    from tracesim.version import __version__

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"$', text, re.M).group(1) == __version__
    assert tracesim.__version__ == __version__
