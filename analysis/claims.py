"""What every claim shares: the verdicts, a claim's result, its inputs and its entry.

A claim is one :class:`Claim` entry: its id, what its estimate measures, the inputs it needs,
the function that evaluates it and (optionally) the check of its own pre-registration fields.
The entries live in :mod:`tracesim.analysis.claim_registry`, which the pre-registration, the claims
table and the report loop over; ``docs/extending.md`` shows how to add one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pandas as pd

__all__ = ["SUPPORTED", "NOT_SUPPORTED", "INCONCLUSIVE", "NOT_EVALUATED", "CERTIFICATES",
           "INPUT_MISSING", "Claim", "ClaimInputs", "ClaimResult", "certified_where",
           "eviction_rows", "eviction_where"]

SUPPORTED = "supported"
NOT_SUPPORTED = "not supported"
INCONCLUSIVE = "inconclusive"
NOT_EVALUATED = "not evaluated"

#: Certificate variants a claim may pre-register (``certificate:`` in data/prereg.yaml).
CERTIFICATES = ("primary", "small_sample")


@dataclass
class ClaimResult:
    """One row of the claims table.

    Attributes
    ----------
    claim : str
        Claim id (``C`` and a number: C0..C12 are built in).
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


#: Why a claim is not evaluated when an input it needs is absent (keys of :attr:`Claim.needs`).
INPUT_MISSING: dict[str, str] = {
    "results": "no replay results given",
    "outcomes": "no in-loop outcomes given",
    "peers": "no `tracesim peers` output given (tracesim report --peers DIR; docs/peers.md)",
}


@dataclass
class ClaimInputs:
    """Everything a claim may read, as the report loaded and checked it.

    Attributes
    ----------
    prereg : tracesim.analysis.prereg.Preregistration
        The validated pre-registration; ``prereg.claims[id]`` is a claim's own entry (typed
        ``Any`` here: :mod:`tracesim.analysis.prereg` reads the claims table, not the other way
        round).
    results : tracesim.analysis.aggregate.ResultsDataset
        Replay or sweep rows (columns in ``docs/columns.md``), read through DuckDB by each
        claim (aggregates, or a filtered read of the rows it needs); empty when none were
        given. A DataFrame given here is wrapped (:meth:`ResultsDataset.from_frame`).
    outcomes : pandas.DataFrame
        In-loop outcome rows of plain eviction (fetch runs are split off); empty when none.
    peers : pandas.DataFrame
        ``tracesim peers`` rows (``tracesim.peers.PEER_COLUMNS``); empty when none.
    adversary : dict or None
        The C0 demo (``adversary.json``).
    traces_dir : Path or None
        The trace store (token log-probs for confidence gating).
    frontier_dir : Path or None
        A ``tracesim frontier`` output whose validity rules C8 uses, when present.
    artifacts : dict
        By-products a claim leaves for the report's figures and tables, keyed
        ``"<claim> <what>"`` (e.g. ``"C1 strata"``).
    """

    prereg: Any
    results: Any = field(default_factory=pd.DataFrame)
    outcomes: pd.DataFrame = field(default_factory=pd.DataFrame)
    peers: pd.DataFrame = field(default_factory=pd.DataFrame)
    adversary: dict[str, Any] | None = None
    traces_dir: Path | None = None
    frontier_dir: Path | None = None
    artifacts: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from tracesim.analysis.aggregate import ResultsDataset

        # The claims ask the results questions in SQL (tracesim.analysis.aggregate): a table
        # given in memory is asked the same questions.
        if isinstance(self.results, pd.DataFrame):
            self.results = ResultsDataset.from_frame(self.results)

    def given(self, name: str) -> bool:
        """Whether the input ``name`` (a key of :data:`INPUT_MISSING`) holds any row."""
        return not getattr(self, name).empty

    def hypothesis(self, claim: str) -> str:
        """The pre-registered hypothesis of ``claim``."""
        return self.prereg.claims[claim]["hypothesis"]


#: ``fail(key, message)`` raises ``ValueError`` naming the pre-registration file and ``key``.
Fail = Callable[[str, str], NoReturn]


@dataclass(frozen=True)
class Claim:
    """One entry of the claims table.

    Attributes
    ----------
    id : str
        ``C`` and a number (the report lists claims in that order).
    evaluate : callable
        ``evaluate(inputs: ClaimInputs) -> ClaimResult``; called only when every input in
        ``needs`` is given. Its p-value (NaN for none) enters Holm's correction.
    units : str
        What the estimate measures, in its units (the claims table prints it).
    needs : tuple of str
        Inputs that must hold rows (keys of :data:`INPUT_MISSING`); without one the claim is
        ``not evaluated`` with the reason. A claim that reads several inputs optionally
        checks them itself.
    check : callable, optional
        ``check(entry, fail)`` validates the claim's own fields of its pre-registration
        entry (``fail``: :data:`Fail`); the common fields are checked for every claim.
    first : bool
        Evaluate before every other claim (a check that should stop the report before any
        work).
    """

    id: str
    evaluate: Callable[[ClaimInputs], ClaimResult]
    units: str
    needs: tuple[str, ...] = ()
    check: Callable[[dict[str, Any], Fail], None] | None = None
    first: bool = False


def eviction_rows(results: pd.DataFrame) -> pd.DataFrame:
    """The rows of eviction designs (schedule ``oneshot`` or ``decode``): per-step designs
    (schedule ``step``) sample the whole cache afresh at every step and evict nothing, so the
    eviction claims C1, C2, C5 and C8 leave them out (C9 is theirs). Results without a
    ``schedule`` column are returned as they are."""
    if "schedule" not in results:
        return results
    keep = results["schedule"] != "step"
    # Without per-step rows the filter would copy the whole table for nothing; a shallow copy
    # (copy-on-write) holds the same rows in the same order.
    return results.copy(deep=False) if keep.all() else results[keep]


def eviction_where(results: Any) -> str:
    """SQL over the results (:class:`tracesim.analysis.aggregate.ResultsDataset`) keeping the
    rows :func:`eviction_rows` keeps."""
    return "\"schedule\" IS DISTINCT FROM 'step'" if "schedule" in results else "TRUE"


def certified_where() -> str:
    """SQL: certified rows with a certificate (``certified`` and ``cert2`` not missing)."""
    return "COALESCE(CAST(\"certified\" AS BOOLEAN), FALSE) AND " + (
        "(\"cert2\" IS NOT NULL AND NOT isnan(\"cert2\"))")
