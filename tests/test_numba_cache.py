"""Numba's cache keyed by the compiled sources (tracesim.numba_cache): an edit to a function
that a cached kernel inlines from another module must reach the kernel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PACKAGE_INIT = (
    "from pathlib import Path\n"
    "from tracesim.numba_cache import versioned_cache\n"
    "versioned_cache(Path(__file__).parent)\n")
CALLEE = "import numba as nb\n\n@nb.njit(cache=True)\ndef g():\n    return {value}\n"
CALLER = ("import numba as nb\nfrom kernelpkg.callee import g\n\n"
          "@nb.njit(cache=True)\ndef f():\n    return g() * 10\n")


def _run(root: Path) -> int:
    out = subprocess.run([sys.executable, "-c", "from kernelpkg.caller import f; print(f())"],
                         cwd=root, capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_an_edit_to_an_inlined_function_reaches_the_cached_caller(tmp_path):
    pkg = tmp_path / "kernelpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(PACKAGE_INIT)
    (pkg / "callee.py").write_text(CALLEE.format(value=1))
    (pkg / "caller.py").write_text(CALLER)
    assert _run(tmp_path) == 10
    assert _run(tmp_path) == 10  # from the cache
    cached = sorted((pkg / "__pycache__").glob("numba-*/caller.f-*.nbi"))
    assert len(cached) == 1
    # The caller's file is untouched (numba's own check sees no change to it).
    (pkg / "callee.py").write_text(CALLEE.format(value=2))
    assert _run(tmp_path) == 20
    assert len(sorted((pkg / "__pycache__").glob("numba-*/caller.f-*.nbi"))) == 2


def test_tracesim_kernels_are_cached_under_the_digest_of_its_sources():
    import tracesim
    import tracesim.kernels.replay  # noqa: F401  (registers the package)
    from tracesim.numba_cache import _ROOTS, source_digest

    root = Path(tracesim.__file__).resolve().parent
    assert _ROOTS[root] == source_digest(root)
