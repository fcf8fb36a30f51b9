"""Holm's step-down correction across pre-registered claims."""

from __future__ import annotations

import numpy as np
from statsmodels.stats.multitest import multipletests

__all__ = ["holm"]


def holm(pvalues: dict[str, float], *, alpha: float = 0.05) -> dict[str, tuple[float, bool]]:
    """Holm-adjusted p-values and rejections, keyed like the input (NaN p-values are skipped)."""
    keys = [k for k, p in pvalues.items() if p is not None and np.isfinite(p)]
    if not keys:
        return {}
    reject, adjusted, _, _ = multipletests([pvalues[k] for k in keys], alpha=alpha, method="holm")
    return {k: (float(a), bool(r)) for k, a, r in zip(keys, adjusted, reject, strict=True)}
