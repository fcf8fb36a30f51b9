"""Install a small pure-Python distribution for a test, without pip.

A package and its ``*.dist-info`` (METADATA, entry_points.txt, RECORD) are written into a
directory that the test puts on ``sys.path`` and ``PYTHONPATH`` (:func:`on_path`), which is all
an installer does for a pure-Python wheel: this process, its subprocesses and Dask workers then
find the distribution's entry points.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def write_dist(root: Path, dist: str, version: str, package: str, source: str,
               entry_points: dict[str, dict[str, str]]) -> None:
    """Write ``package/__init__.py`` holding ``source`` and its dist-info declaring
    ``entry_points`` ({group: {name: "module:attribute"}}) into ``root`` (rewritten in place
    when called again: an edited plugin)."""
    pkg = root / package
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(source)
    info = root / f"{package}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{n} = {target}\n" for n, target in names.items())
        for group, names in entry_points.items()))
    digest = hashlib.sha256(source.encode()).hexdigest()
    (info / "RECORD").write_text(f"{package}/__init__.py,sha256={digest},{len(source)}\n"
                                 f"{info.name}/METADATA,,\n{info.name}/entry_points.txt,,\n"
                                 f"{info.name}/RECORD,,\n")


@contextmanager
def on_path(root: Path) -> Iterator[None]:
    """``root`` on ``sys.path`` and ``PYTHONPATH`` for the block (undone after)."""
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(root))
    old = os.environ.get("PYTHONPATH", "")
    mp.setenv("PYTHONPATH", f"{root}{os.pathsep}{old}" if old else str(root))
    importlib.invalidate_caches()
    try:
        yield
    finally:
        mp.undo()
