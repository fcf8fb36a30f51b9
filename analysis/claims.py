"""Claim results and the verdict rules shared by every analysis."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["SUPPORTED", "NOT_SUPPORTED", "INCONCLUSIVE", "NOT_EVALUATED", "CLAIM_UNITS",
           "ClaimResult", "claims_table"]

SUPPORTED = "supported"
NOT_SUPPORTED = "not supported"
INCONCLUSIVE = "inconclusive"
NOT_EVALUATED = "not evaluated"

#: What each claim's estimate measures, in its units (printed in the report's claims table).
CLAIM_UNITS: dict[str, str] = {
    "C0": "ratio: top-k true squared error at the largest perturbation / at none",
    "C1": "coverage: share of certified (query, head, config) events inside the interval",
    "C2": "difference in mean relative error |ô−o|/|o|, Poisson/Hájek − top-k",
    "C3": "difference in accuracy (share correct), question-aware SnapKV − full cache",
    "C4": "AUC difference for failure, −mean log-prob − mean certificate",
    "C5": "difference in mean relative error, certificate-gated − uniform at matched memory",
    "C6": "AUC of the max certificate, cache-induced vs inherent failures",
    "C7": "difference in share of squared error recovered, certificate − best alternative",
}


@dataclass
class ClaimResult:
    """One row of the claims table.

    Attributes
    ----------
    claim : str
        Claim id (C0..C7).
    hypothesis : str
    estimate : float
        The primary estimate (coverage, mean difference, AUC difference, ...).
    ci_low, ci_high : float
        Its confidence interval (NaN when not applicable).
    pvalue : float
        Raw p-value of the primary test (NaN for demonstrations).
    verdict : str
        supported / not supported / inconclusive / not evaluated.
    detail : str
        One line on what was compared and how much data there was.
    adjusted_pvalue : float
        Holm-adjusted p-value (filled in by the report).
    extra : dict
        Further numbers the report prints.
    """

    claim: str
    hypothesis: str
    estimate: float = float("nan")
    ci_low: float = float("nan")
    ci_high: float = float("nan")
    pvalue: float = float("nan")
    verdict: str = NOT_EVALUATED
    detail: str = ""
    adjusted_pvalue: float = float("nan")
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        ci = ("" if np.isnan(self.ci_low) else f" [{self.ci_low:.4g}, {self.ci_high:.4g}]")
        p = "" if np.isnan(self.pvalue) else f", p = {self.pvalue:.3g}"
        return f"{self.claim}: {self.verdict} — estimate {self.estimate:.4g}{ci}{p}. {self.detail}"


def _fmt(x: float, digits: int = 3) -> str:
    return "—" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.{digits}g}"


def claims_table(results: list[ClaimResult], *, text: bool = False) -> list[list[str]]:
    """Rows (header first) of the claims table: id, estimate, CI, p, Holm p, verdict; with
    ``text``, also the claim's hypothesis and the estimate's units (after the id)."""
    head = ["claim", "estimate", "CI", "p", "p (Holm)", "verdict"]
    rows = [head[:1] + ["hypothesis", "estimate measures"] + head[1:] if text else head]
    for r in results:
        ci = "—" if np.isnan(r.ci_low) else f"[{_fmt(r.ci_low)}, {_fmt(r.ci_high)}]"
        words = [r.hypothesis, CLAIM_UNITS.get(r.claim, "")] if text else []
        rows.append([r.claim, *words, _fmt(r.estimate, 4), ci, _fmt(r.pvalue),
                     _fmt(r.adjusted_pvalue), r.verdict])
    return rows
