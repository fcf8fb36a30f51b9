"""The pre-registration file: loading, validation and the hash that ties results to it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracesim.provenance import prereg_sha256

__all__ = ["CLAIM_IDS", "PreregChangedError", "Preregistration", "check_prereg_hash",
           "load_prereg", "prereg_hash"]

CLAIM_IDS = ("C0", "C1", "C2", "C3", "C4", "C5", "C6", "C7", "C8", "C9", "C10")
_REQUIRED = ("hypothesis", "metric", "compare", "test", "verdict")
_EVENTS = ("wald", "satterthwaite")
_CERTIFICATES = ("primary", "small_sample")


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
    claims = doc.get("claims")
    if not isinstance(claims, dict) or not claims:
        fail("claims", "expected a non-empty mapping of claim id to claim")
    for cid, claim in claims.items():
        if cid not in CLAIM_IDS:
            fail(f"claims.{cid}", f"unknown claim id; expected one of {list(CLAIM_IDS)}")
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
    missing = [c for c in CLAIM_IDS if c not in claims]
    if missing:
        fail("claims", f"every claim must be pre-registered; missing {missing}")
    c1 = claims["C1"]
    if c1.get("primary_event") not in _EVENTS:
        fail("claims.C1.primary_event", f"expected one of {list(_EVENTS)}")
    if c1.get("certificate") not in _CERTIFICATES:
        fail("claims.C1.certificate", f"expected one of {list(_CERTIFICATES)}")
    if not isinstance(c1.get("nominal"), (int, float)) or not 0 < c1["nominal"] < 1:
        fail("claims.C1.nominal", "expected a number in (0, 1)")
    _check_c8(claims["C8"], fail)
    return Preregistration(path=path, sha256=prereg_hash(path), alpha=float(alpha),
                           multiplicity="holm", claims=dict(claims))


def _check_c8(c8: dict[str, Any], fail) -> None:
    """The validity rule's split, interval and candidate grid (see ``analysis.validity``)."""
    split = c8.get("split")
    if not isinstance(split, dict):
        fail("claims.C8.split", "expected a mapping {unit, salt, calibration_fraction}")
    if split.get("unit", "sequence") != "sequence":
        fail("claims.C8.split.unit", "only 'sequence' is supported")
    if not isinstance(split.get("salt"), str) or not split["salt"]:
        fail("claims.C8.split.salt", "expected a non-empty string")
    f = split.get("calibration_fraction")
    if not isinstance(f, (int, float)) or not 0 < f < 1:
        fail("claims.C8.split.calibration_fraction", f"expected a number in (0, 1), got {f!r}")
    iv = c8.get("interval")
    if (not isinstance(iv, list) or len(iv) != 2
            or not all(isinstance(v, (int, float)) for v in iv) or not 0 < iv[0] < iv[1] < 1):
        fail("claims.C8.interval", f"expected [low, high] with 0 < low < high < 1, got {iv!r}")
    if c8.get("certificate", "primary") not in _CERTIFICATES:
        fail("claims.C8.certificate", f"expected one of {list(_CERTIFICATES)}")
    if not isinstance(c8.get("nominal"), (int, float)) or not 0 < c8["nominal"] < 1:
        fail("claims.C8.nominal", "expected a number in (0, 1)")
    grid = c8.get("grid", {})
    if not isinstance(grid, dict):
        fail("claims.C8.grid", "expected a mapping of threshold name to a list of numbers")
    for key, vals in grid.items():
        if key not in ("min_tail", "min_neff", "max_weight"):
            fail(f"claims.C8.grid.{key}", "unknown key; expected min_tail, min_neff, max_weight")
        if not isinstance(vals, list) or not vals or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            fail(f"claims.C8.grid.{key}", f"expected a non-empty list of numbers, got {vals!r}")


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
