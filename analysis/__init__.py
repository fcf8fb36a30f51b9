"""Statistics for pre-registered claims: coverage, equivalence, AUC, multiplicity."""

from __future__ import annotations

from tracesim.analysis.auc import AUCResult, PairedAUCResult, delong_auc, delong_paired_test
from tracesim.analysis.coverage import CoverageResult, calibration_curve, cluster_coverage
from tracesim.analysis.equivalence import EquivalenceResult, paired_noninferiority, paired_tost
from tracesim.analysis.multiplicity import holm

__all__ = [
    "AUCResult",
    "CoverageResult",
    "EquivalenceResult",
    "PairedAUCResult",
    "calibration_curve",
    "cluster_coverage",
    "delong_auc",
    "delong_paired_test",
    "holm",
    "paired_noninferiority",
    "paired_tost",
]
