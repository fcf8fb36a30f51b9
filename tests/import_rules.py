"""The import rules of ``docs/extending.md``, checked by walking every import of the package.

:func:`module_sources` maps each module of the installed layout (``capture/x.py`` is
``tracesim.capture.x``) to its source; :func:`imports_of` lists what one module imports: import
statements anywhere in it (inside functions too, relative ones resolved) and, in a module that
calls ``import_module`` or ``__import__``, every string constant that names a module of the
project or a top-level package named by a rule; :func:`breaches` holds them against the rules
read from the table between the ``import-rules`` markers of ``docs/extending.md``.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "extending.md"
# Folder of the repository -> the package it installs as (pyproject.toml's package-dir).
FOLDERS = {"tracesim": "tracesim", "capture": "tracesim.capture", "analysis": "tracesim.analysis"}


@dataclass(frozen=True)
class Rule:
    importers: tuple[str, ...]
    excepted: tuple[str, ...]
    forbidden: tuple[str, ...]

    def governs(self, module: str) -> bool:
        return _under(module, self.importers) and not _under(module, self.excepted)

    def forbids(self, target: str) -> bool:
        return _under(target, self.forbidden)


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def read_rules(doc: Path = DOC) -> list[Rule]:
    text = doc.read_text(encoding="utf-8")
    block = re.search(r"<!-- import-rules: begin -->(.*?)<!-- import-rules: end -->", text, re.S)
    if block is None:
        raise AssertionError(f"{doc}: no import-rules table")
    rules = []
    for line in block.group(1).strip().splitlines()[2:]:  # skip the header and its rule
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = [tuple(re.findall(r"`([\w.]+)`", c)) for c in cells]
        rules.append(Rule(*names))
    return rules


def module_sources(root: Path = ROOT) -> dict[str, str]:
    sources = {}
    for folder, package in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            sources[".".join([package, *parts])] = path.read_text(encoding="utf-8")
    return sources


def _is_package(module: str, sources: dict[str, str]) -> bool:
    return any(other.startswith(module + ".") for other in sources)


def imports_of(module: str, source: str, sources: dict[str, str],
               named: tuple[str, ...] = ()) -> list[tuple[int, str]]:
    """(line, imported module) for every import of ``module``."""
    tree = ast.parse(source)
    package = module if _is_package(module, sources) else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    dynamic = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names
                      if f"{base}.{alias.name}" in sources]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__"):
                dynamic = True
    if dynamic:
        roots = tuple(sources) + named
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and (node.value in sources or _under(node.value, named))
                    and any(node.value == r or node.value.startswith(r + ".") for r in roots)):
                found.append((node.lineno, node.value))
    return found


def breaches(sources: dict[str, str], rules: list[Rule]) -> list[str]:
    named = tuple({name for rule in rules for name in rule.forbidden if "." not in name})
    out = []
    for module, source in sorted(sources.items()):
        governing = [rule for rule in rules if rule.governs(module)]
        if not governing:
            continue
        for line, target in imports_of(module, source, sources, named):
            for rule in governing:
                if rule.forbids(target):
                    out.append(f"{module}:{line} imports {target} (rule: "
                               f"{', '.join(rule.importers)} may not import "
                               f"{', '.join(rule.forbidden)})")
    return out
