"""The claims table: one :class:`~tracesim.analysis.claims.Claim` entry per pre-registered claim.

The pre-registration (:func:`tracesim.analysis.prereg.load_prereg`: which ids must be registered and
their own field checks), the claims table of the report (:func:`claims_table`: what each
estimate measures) and the report (:func:`tracesim.analysis.report.build_report`: what to evaluate,
on
which inputs) all loop over :func:`registered_claims`. The table is
:data:`tracesim.registry.CLAIM_REGISTRY`. A new claim is one entry: in :data:`BUILTIN_CLAIMS`
for the project's own; for a claim defined outside the package, a :class:`Claim` declared under
the entry-point group ``tracesim.claims`` (every process finds it: ``tracesim report``, a Dask
worker) or one :func:`register_claim` call for this process (``docs/extending.md``).
"""

from __future__ import annotations

import re

import numpy as np
from tracesim.analysis.claims import INPUT_MISSING, Claim, ClaimResult
from tracesim.analysis.claims_c8 import c8_claim, check_c8
from tracesim.analysis.claims_c12 import c12_claim
from tracesim.analysis.claims_gating import c5_claim, c7_claim
from tracesim.analysis.claims_outcomes import c3_claim, c4_claim, c6_claim
from tracesim.analysis.claims_perstep import c9_claim, c10_claim, c11_claim
from tracesim.analysis.claims_replay import (
    c0_claim,
    c1_claim,
    c2_claim,
    check_c1,
)

from tracesim.registry import CLAIM_REGISTRY

__all__ = ["BUILTIN_CLAIMS", "claim_ids", "claim_units", "claims_table", "register_claim",
           "registered_claims", "unregister_claim"]

BUILTIN_CLAIMS: tuple[Claim, ...] = (
    Claim("C0", c0_claim,
          "ratio: top-k true squared error at the largest perturbation / at none"),
    Claim("C1", c1_claim,
          "coverage: share of certified (query, head, config) events inside the interval",
          needs=("results",), check=check_c1),
    Claim("C2", c2_claim, "difference in mean relative error |ô−o|/|o|, Poisson/Hájek − top-k"),
    Claim("C3", c3_claim,
          "difference in accuracy (share correct), question-aware SnapKV − full cache",
          needs=("outcomes",)),
    Claim("C4", c4_claim, "AUC difference for failure, −mean log-prob − mean certificate",
          needs=("outcomes",)),
    Claim("C5", c5_claim,
          "difference in mean relative error, certificate-gated − uniform at matched memory",
          needs=("results",)),
    Claim("C6", c6_claim, "AUC of the max certificate, cache-induced vs inherent failures",
          needs=("outcomes",)),
    Claim("C7", c7_claim,
          "difference in share of squared error recovered, certificate − best alternative",
          needs=("results",)),
    # First: a validity rule fitted on held-out sequences stops the report before any work.
    Claim("C8", c8_claim,
          "coverage: share of the held-out rows the validity rule certifies inside the interval",
          needs=("results",), check=check_c8, first=True),
    Claim("C9", c9_claim,
          "coverage: share of held-out rows of the per-step Poisson design inside the interval"),
    Claim("C10", c10_claim,
          "violation rate of ‖ô − o‖ ≤ ε‖o‖ per (query head, step), the vAttention "
          "configuration nearest its δ", needs=("peers",)),
    Claim("C11", c11_claim,
          "coverage: share of held-out Gemma 3 rows of the per-step Poisson design inside the "
          "interval"),
    Claim("C12", c12_claim,
          "difference in needle accuracy (share correct), Conf-KV − fixed budget at matched "
          "mean kept tokens", needs=("outcomes",)),
)

_ID = re.compile(r"C(0|[1-9][0-9]*)")
CLAIM_REGISTRY.install({c.id: c for c in BUILTIN_CLAIMS}, Claim)


def _number(claim_id: str) -> int:
    return int(claim_id[1:])


def register_claim(claim: Claim) -> Claim:
    """Add a claim to the table for this process; returns it.

    From then on :func:`tracesim.analysis.prereg.load_prereg` requires a pre-registration entry for
    it
    (and runs its ``check``), and :func:`tracesim.analysis.report.build_report` evaluates it.

    Raises
    ------
    ValueError
        When the id is not ``C`` and a number, is already registered, or a need is not one of
        the report's inputs (:data:`tracesim.analysis.claims.INPUT_MISSING`).
    """
    if not isinstance(claim, Claim):
        raise ValueError("register_claim: expected a tracesim.analysis.claims.Claim, got "
                         f"{claim!r}")
    if not _ID.fullmatch(claim.id):
        raise ValueError(f"claim id {claim.id!r}: expected C and a number, e.g. C11")
    if claim.id in CLAIM_REGISTRY.builtins or claim.id in CLAIM_REGISTRY.registered:
        raise ValueError(f"claim {claim.id} is already registered")
    _check_needs(claim)
    return CLAIM_REGISTRY.register(claim)


def _check_needs(claim: Claim) -> None:
    unknown = [n for n in claim.needs if n not in INPUT_MISSING]
    if unknown:
        raise ValueError(f"claim {claim.id}: needs {unknown}, expected inputs among "
                         f"{list(INPUT_MISSING)}")


def unregister_claim(claim_id: str) -> None:
    """Remove a claim added by :func:`register_claim` (the built-in claims stay)."""
    if claim_id in CLAIM_REGISTRY.builtins:
        raise ValueError(f"claim {claim_id} is built in; it cannot be unregistered")
    if claim_id not in CLAIM_REGISTRY.registered:
        raise ValueError(f"claim {claim_id} is not registered")
    CLAIM_REGISTRY.unregister(claim_id)


def registered_claims() -> list[Claim]:
    """Every claim of the table (built-ins, :func:`register_claim` registrations and the
    ``tracesim.claims`` entry points, each loaded), in id order (C0, C1, ..., C10, C11, ...).

    Raises
    ------
    ValueError
        When an entry point fails to import, is not a :class:`Claim` whose id is its entry-point
        name (``C`` and a number), or needs an input the report does not have.
    """
    out = []
    for claim_id in CLAIM_REGISTRY.names():
        if not _ID.fullmatch(claim_id):
            raise ValueError(f"claim plugin {claim_id!r}: expected an id C and a number, "
                             "e.g. C11")
        claim = CLAIM_REGISTRY[claim_id]
        _check_needs(claim)
        out.append(claim)
    return sorted(out, key=lambda c: _number(c.id))


def claim_ids() -> list[str]:
    """The ids of :func:`registered_claims`."""
    return [c.id for c in registered_claims()]


def claim_units(claim_id: str) -> str:
    """What the claim's estimate measures, in its units ("" for an unknown id)."""
    claim = CLAIM_REGISTRY.get(claim_id)
    return claim.units if claim is not None else ""


def _fmt(x: float, digits: int = 3) -> str:
    return "—" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.{digits}g}"


def claims_table(results: list[ClaimResult], *, text: bool = False) -> list[list[str]]:
    """Rows (header first) of the claims table: id, estimate, CI, p, Holm p, verdict; with
    ``text``, also the claim's hypothesis and the estimate's units (after the id)."""
    head = ["claim", "estimate", "CI", "p", "p (Holm)", "verdict"]
    rows = [head[:1] + ["hypothesis", "estimate measures"] + head[1:] if text else head]
    for r in results:
        ci = "—" if np.isnan(r.ci_low) else f"[{_fmt(r.ci_low)}, {_fmt(r.ci_high)}]"
        words = [r.hypothesis, claim_units(r.claim)] if text else []
        rows.append([r.claim, *words, _fmt(r.estimate, 4), ci, _fmt(r.pvalue),
                     _fmt(r.adjusted_pvalue), r.verdict])
    return rows
