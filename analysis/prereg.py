"""The pre-registration file: loading, validation and the hash that ties results to it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracesim.analysis.claim_registry import registered_claims

from tracesim.digests import prereg_sha256

__all__ = ["PreregChangedError", "Preregistration", "check_prereg_hash", "load_prereg",
           "prereg_hash"]

_REQUIRED = ("hypothesis", "metric", "compare", "test", "verdict")


class PreregChangedError(RuntimeError):
    """The pre-registration changed after the results were produced."""


@dataclass(frozen=True)
class Preregistration:
    """A validated pre-registration: global settings plus one dict per claim."""

    path: Path
    sha256: str
    alpha: float
    multiplicity: str
    claims: dict[str, dict[str, Any]] = field(default_factory=dict)

    def claim_alpha(self, claim: str) -> float:
        return float(self.claims[claim].get("alpha", self.alpha))


def prereg_hash(path: str | Path) -> str:
    """``sha256:<hex>`` of the file's bytes (what results summaries record)."""
    return prereg_sha256(path)


def load_prereg(path: str | Path) -> Preregistration:
    """Load and validate a pre-registration file (:func:`tracesim.safeio.read_yaml`; nothing is
    executed).

    Every claim of the claims table (:func:`tracesim.analysis.claim_registry.registered_claims`)
    must
    have an entry, no other id may, and each claim's own ``check`` runs on its entry after the
    common fields are checked.

    Raises
    ------
    ValueError
        Naming the file and the key on any problem.
    """
    path = Path(path)
    from tracesim.safeio import read_yaml

    try:
        doc = read_yaml(path, "pre-registration file")
    except FileNotFoundError:
        raise ValueError(f"{path}: pre-registration file not found") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")

    def fail(key: str, message: str) -> None:
        raise ValueError(f"{path}: {key}: {message}")

    alpha = doc.get("alpha")
    if not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        fail("alpha", f"expected a number in (0, 1), got {alpha!r}")
    if doc.get("multiplicity", "holm") != "holm":
        fail("multiplicity", f"only 'holm' is supported, got {doc.get('multiplicity')!r}")
    table = registered_claims()
    claim_ids = [c.id for c in table]
    claims = doc.get("claims")
    if not isinstance(claims, dict) or not claims:
        fail("claims", "expected a non-empty mapping of claim id to claim")
    for cid, claim in claims.items():
        if cid not in claim_ids:
            fail(f"claims.{cid}", f"unknown claim id; expected one of {claim_ids}")
        if not isinstance(claim, dict):
            fail(f"claims.{cid}", "expected a mapping")
        for key in _REQUIRED:
            if key not in claim:
                fail(f"claims.{cid}.{key}", "missing")
        a = claim.get("alpha", alpha)
        if not isinstance(a, (int, float)) or not 0 < a < 1:
            fail(f"claims.{cid}.alpha", f"expected a number in (0, 1), got {a!r}")
        if "margin" in claim and (not isinstance(claim["margin"], (int, float))
                                  or claim["margin"] < 0):
            fail(f"claims.{cid}.margin", f"expected a non-negative number, got {claim['margin']!r}")
    missing = [c for c in claim_ids if c not in claims]
    if missing:
        fail("claims", f"every claim must be pre-registered; missing {missing}")
    for claim in table:
        if claim.check is not None:
            claim.check(claims[claim.id], fail)
    return Preregistration(path=path, sha256=prereg_hash(path), alpha=float(alpha),
                           multiplicity="holm", claims=dict(claims))


def check_prereg_hash(prereg: Preregistration, recorded: str | None, *,
                      allow_change: bool = False) -> bool:
    """Compare the file's hash with the one recorded in a results summary.

    Returns True when they match. Raises :class:`PreregChangedError` on a mismatch (or a missing
    record) unless ``allow_change``, in which case it returns False so the report can say so.
    """
    if recorded == prereg.sha256:
        return True
    if allow_change:
        return False
    raise PreregChangedError(
        f"{prereg.path} changed after the results were produced (recorded {recorded}, now "
        f"{prereg.sha256}); rerun the study, or pass --allow-prereg-change to report anyway")
