"""C12: Conf-KV's confidence-driven budget against a fixed budget with the same ranking and the
same protected window, at matched mean kept tokens, in the loop (``data/prereg.yaml``).

Evaluated from in-loop outcomes (``tracesim evict``) of Conf-KV and its fixed-budget twin on
each pre-registered model; until such outcomes are given the claim is ``not evaluated``.
"""

from __future__ import annotations

from tracesim.analysis.claims import ClaimInputs, ClaimResult

__all__ = ["c12_claim"]


def c12_claim(inputs: ClaimInputs) -> ClaimResult:
    """C12 as a row of the claims table."""
    claim = inputs.prereg.claims["C12"]
    outcomes = inputs.outcomes
    if outcomes.empty or "score" not in outcomes or not (outcomes["score"] == "confkv").any():
        return ClaimResult("C12", claim["hypothesis"],
                           detail="no Conf-KV in-loop outcomes given (tracesim evict)")
    return ClaimResult("C12", claim["hypothesis"],
                       detail="Conf-KV outcomes given but the C12 test is not implemented yet")
