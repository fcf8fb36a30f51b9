"""Numba's on-disk cache, keyed by every compiled source of tracesim.

Numba decides whether a cached kernel is still valid from the modification time and size of the
one file that defines it. A kernel that calls a compiled function of another module has that
function inlined into its machine code, so after an edit to the other module (a ``git pull``, a
branch switch, a patch) the cached kernel silently keeps the old code. tracesim's kernels call
across modules throughout (the replay kernel inlines the fused products, the event kernels and
the permanent random numbers of :mod:`tracesim.prn`), so every cache of a registered package is
kept under a directory named after a digest of all its compiled sources: any edit to any of them
selects a fresh directory and every kernel is compiled again from the code on disk.

A user's ``NUMBA_CACHE_DIR`` takes precedence (numba's own locator is asked first). When the
package's ``__pycache__`` is not writable, numba's user-wide cache is used as before.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

#: Package folders whose compiled functions are cached under a source digest.
_ROOTS: dict[Path, str] = {}


def source_digest(root: Path) -> str:
    """The first 16 hex digits of the sha256 of every ``.py`` file under ``root`` that mentions
    numba (relative path and bytes, in sorted order)."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        data = path.read_bytes()
        if b"numba" in data:
            h.update(str(path.relative_to(root)).encode() + b"\0" + data + b"\0")
    return h.hexdigest()[:16]


def versioned_cache(root: str | os.PathLike[str]) -> None:
    """Cache the compiled functions defined under ``root`` in
    ``__pycache__/numba-<digest>/`` beside their sources (:func:`source_digest`).

    Call it before the first ``@numba.njit(cache=True)`` of the package runs (a package's
    ``__init__``, or the top of a module that compiles). Calling it again is free.
    """
    root = Path(root).resolve()
    if root in _ROOTS:
        return
    _ROOTS[root] = source_digest(root)
    _install()


def _install() -> None:
    from numba.core import caching

    if getattr(caching, "_tracesim_locator", None) is not None:
        return

    class DigestCacheLocator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
        """Numba cache locator for the functions of a registered package: the package's
        ``__pycache__/numba-<digest>`` (the digest of all its compiled sources)."""

        def __init__(self, py_func, py_file: str, cache_path: str) -> None:
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = cache_path

        def get_cache_path(self) -> str:
            return self._cache_path

        @classmethod
        def from_function(cls, py_func, py_file):
            if not os.path.exists(py_file):
                return None
            path = Path(py_file).resolve()
            for root, digest in _ROOTS.items():
                if path.is_relative_to(root):
                    cache = path.parent / "__pycache__" / f"numba-{digest}"
                    self = cls(py_func, py_file, str(cache))
                    try:
                        self.ensure_cache_path()
                    except OSError:
                        return None  # not writable: numba's user-wide cache
                    return self
            return None

    # numba 0.59 names these CacheImpl / UserProvidedCacheLocator; earlier releases with an
    # underscore in front
    impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl
    user = (getattr(caching, "UserProvidedCacheLocator", None)
            or caching._UserProvidedCacheLocator)
    classes = impl._locator_classes
    # After numba's user-provided locator (NUMBA_CACHE_DIR wins), before the in-tree one.
    at = 1 if classes and classes[0] is user else 0
    classes.insert(at, DigestCacheLocator)
    caching._tracesim_locator = DigestCacheLocator
