"""Building a registered component (design, score) from its name and hyperparameters."""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["build"]


def build(registry: dict[str, type[T]], kind: str, name: str, params: dict[str, Any]) -> T:
    """``registry[name](**params)`` with errors that name the kind, the name and the choices."""
    try:
        cls = registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; expected one of {sorted(registry)}") from None
    try:
        return cls(**params)
    except TypeError as exc:
        raise ValueError(f"{kind} {name!r}: {exc}") from None
