"""Numba kernels. Each module holds compiled loops only; the public API lives one level up."""

from pathlib import Path

from tracesim.numba_cache import versioned_cache

# Before any kernel is compiled: the kernels inline each other's functions, so their cache is
# keyed by all of tracesim's compiled sources (tracesim.numba_cache).
versioned_cache(Path(__file__).resolve().parent.parent)
