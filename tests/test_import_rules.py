"""The house's import rules (docs/extending.md) hold, and the checker catches a planted breach."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys

from tests.import_rules import ROOT, breaches, module_sources, read_rules


def test_rules_are_read_from_the_docs():
    rules = read_rules()
    assert len(rules) >= 5
    core = rules[0]
    assert core.governs("tracesim.replay.engine")
    assert not core.governs("tracesim.app.cli")
    assert core.forbids("tracesim.capture.runner") and core.forbids("torch.nn")


def test_no_module_breaks_an_import_rule():
    assert breaches(module_sources(), read_rules()) == []


def test_a_planted_breach_is_caught():
    sources = module_sources()
    rules = read_rules()
    planted = dict(sources)
    # inside a function, as core modules that reach up usually do
    planted["tracesim.replay.planted_a"] = (
        "def f():\n    from tracesim.analysis.report import build_report\n")
    # a module name handed to import_module
    planted["tracesim.sweep.planted_b"] = (
        "import importlib\nNAME = 'tracesim.capture.runner'\n"
        "def g():\n    return importlib.import_module(NAME)\n")
    # a relative import from the bottom floor up to the policies
    planted["tracesim.proxies.planted_c"] = "from ..policies import Score\n"
    # torch at import time in the core
    planted["tracesim.planted_d"] = "import torch\n"
    # the recorder reaching into the in-loop room
    planted["tracesim.capture.planted_e"] = "from .inloop import evict\n"
    found = breaches(planted, rules)
    for name in "abcde":
        assert any(f"planted_{name}:" in line for line in found), (name, found)
    assert all(line.split(":")[0].rpartition(".")[2].startswith("planted_") for line in found)


def test_every_package_folder_is_installed_under_tracesim():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    block = re.search(r"^packages = \[(.*?)\]", text, re.S | re.M)
    listed = set(re.findall(r'"([\w.]+)"', block.group(1)))
    packages = {m for m, _ in module_sources().items()
                if any(o.startswith(m + ".") for o in module_sources())}
    packages |= {"tracesim", "tracesim.capture", "tracesim.analysis"}
    have_init = {m for m in packages
                 if (ROOT / m.replace("tracesim.capture", "capture")
                     .replace("tracesim.analysis", "analysis").replace(".", "/")
                     / "__init__.py").exists()}
    assert have_init <= listed, sorted(have_init - listed)
    assert all(name == "tracesim" or name.startswith("tracesim.") for name in listed)


def test_the_distribution_provides_only_tracesim():
    provided = {top for top, dists in importlib.metadata.packages_distributions().items()
                if "tracesim" in dists}
    assert provided == {"tracesim"}


def test_tracesim_imports_without_torch_or_its_consumers():
    code = ("import sys, tracesim, tracesim.replay, tracesim.sweep, tracesim.tiers; "
            "import tracesim.peers, tracesim.policies, tracesim.proxies; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
            "or m.startswith(('tracesim.capture', 'tracesim.analysis', 'tracesim.app'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
