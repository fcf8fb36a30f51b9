"""The package version, one place (pyproject.toml carries the same string; a test checks it)."""

__version__ = "0.1.0"
