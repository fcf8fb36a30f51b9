"""Numba kernels. Each module holds compiled loops only; the public API lives one level up."""
