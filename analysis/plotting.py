"""Matplotlib on the Agg backend and figures as PNG bytes, shared by every module that draws."""

from __future__ import annotations

import io
from typing import Any

__all__ = ["png_bytes", "pyplot"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` with the non-interactive Agg backend selected (no display needed).

    Imported on first use so that reading results never pulls in matplotlib.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig: Any) -> bytes:
    """The figure as PNG bytes (110 dpi, tight bounding box); the figure is closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return buf.getvalue()
