"""The validity rule (claim C8): when may a row's certificate be trusted?

A certificate is *declared valid* for a row only when a rule on quantities the server knows
holds for it:

    tail_size >= min_tail  and  n_eff >= min_neff  [and  max_tail_weight <= max_weight]

(realised tail size m, Kish effective sample size of the Hájek weights over the kept tail, and,
when the results carry it, the largest kept-tail Hájek weight). Rows failing the rule are
reported as *not certified*, never as covered.

**Split.** Sequences, not rows, are split, because rows of one sequence share tokens and heads.
A sequence is in the calibration split iff ``h(salt, sequence_id) < fraction``, with ``h`` the
first 64 bits of ``sha256(salt + "\\x00" + sequence_id)`` divided by 2**64. The salt and the
fraction are pre-registered (``data/prereg.yaml``, claim C8), so the split is fixed before any
held-out row is read, does not depend on which other sequences are present, and is identical
on every machine.

**Fitting rule (exact).** One rule per certified configuration (``config_id``), fitted on the
calibration sequences' rows only. Every candidate of the pre-registered grid (the Cartesian
product of ``min_tail``, ``min_neff`` and ``max_weight`` values) is scored by its calibration
coverage (mean of the coverage column over the rows it certifies) and its certified fraction
(share of the configuration's calibration rows it certifies). Candidates certifying fewer than
``min_certified`` of the rows or rows of fewer than two sequences are ineligible. Among the
eligible candidates whose coverage is >= nominal, the one with the largest certified fraction
wins (ties: larger coverage, then earlier in grid order). If none reaches nominal, the eligible
candidate with the largest coverage wins (ties: larger certified fraction) and the rule is
marked ``reached = False``.

**Guard.** A fitted rule records its calibration sequence ids and their sha256. Before a rule
is evaluated, :func:`check_rules` refuses (``ValidityRuleError``) a rule whose salt/fraction
differ from the pre-registration, whose id list does not match its hash, or whose calibration
ids include a sequence that is held out under the pre-registered split or among the rows being
evaluated.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tracesim.atomic import atomic_write_bytes

__all__ = ["DEFAULT_GRID", "SplitSettings", "ValidityRule", "ValidityRuleError", "apply_rules",
           "as_text", "check_rules", "fit_rule", "fit_rules", "ids_hash", "load_rules",
           "save_rules", "split_sequences"]

#: Candidate thresholds when a pre-registration gives none.
DEFAULT_GRID: dict[str, list[float]] = {
    "min_tail": [1, 2, 4, 8, 16, 32, 64],
    "min_neff": [0, 2, 4, 8, 16, 32, 64],
    "max_weight": [1.0, 0.5, 0.25, 0.1, 0.05],
}


class ValidityRuleError(ValueError):
    """A validity rule that must not be evaluated (fit on held-out sequences, tampered, ...)."""


@dataclass(frozen=True)
class SplitSettings:
    """The pre-registered split and fitting settings of claim C8.

    Parameters
    ----------
    salt : str
        Salt of the sequence hash.
    fraction : float
        Expected share of sequences in the calibration split, in (0, 1).
    nominal : float
        Coverage the calibration split must reach.
    coverage_column : str
        Result column of the coverage event (``wald_cov`` for the primary Wald event).
    grid : dict
        Candidate thresholds (``min_tail``, ``min_neff``, ``max_weight``).
    min_certified : float
        Smallest certified share of a configuration's calibration rows for a candidate.
    """

    salt: str
    fraction: float
    nominal: float = 0.95
    coverage_column: str = "wald_cov"
    grid: dict[str, list[float]] = field(default_factory=lambda: dict(DEFAULT_GRID))
    min_certified: float = 0.01

    def __post_init__(self) -> None:
        if not isinstance(self.salt, str) or not self.salt:
            raise ValueError("SplitSettings.salt: expected a non-empty string")
        if not 0 < self.fraction < 1:
            raise ValueError(f"SplitSettings.fraction = {self.fraction}: expected in (0, 1)")
        if not 0 < self.nominal < 1:
            raise ValueError(f"SplitSettings.nominal = {self.nominal}: expected in (0, 1)")
        for key in ("min_tail", "min_neff", "max_weight"):
            vals = self.grid.get(key)
            if not isinstance(vals, list) or not vals or not all(
                    isinstance(v, (int, float)) for v in vals):
                raise ValueError(f"SplitSettings.grid.{key}: expected a non-empty list of "
                                 f"numbers, got {vals!r}")

    @classmethod
    def from_claim(cls, claim: dict[str, Any]) -> SplitSettings:
        """From the C8 entry of a pre-registration (validated by ``load_prereg``)."""
        split = claim["split"]
        column = {"primary": "wald_cov", "small_sample": "wald_t_cov"}[
            claim.get("certificate", "primary")]
        grid = {**DEFAULT_GRID, **claim.get("grid", {})}
        return cls(salt=str(split["salt"]), fraction=float(split["calibration_fraction"]),
                   nominal=float(claim.get("nominal", 0.95)), coverage_column=column,
                   grid=grid, min_certified=float(claim.get("min_certified", 0.01)))


def _unit(salt: str, sequence_id: str) -> float:
    digest = hashlib.sha256(f"{salt}\x00{sequence_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def as_text(ids: pd.Series) -> pd.Series:
    """Ids as strings; a column of strings as it is (``astype(str)`` would copy every row's
    text into pandas' string dtype, gigabytes on a large results read)."""
    return ids if pd.api.types.is_string_dtype(ids) else ids.astype(str)


def split_sequences(sequence_ids, salt: str, fraction: float) -> dict[str, bool]:
    """``{sequence_id: True if calibration else False}`` (see the module docstring)."""
    return {str(s): _unit(salt, str(s)) < fraction for s in sorted(set(map(str, sequence_ids)))}


def ids_hash(ids) -> str:
    """``sha256:<hex>`` of the sorted, newline-joined distinct ids."""
    text = "\n".join(sorted(set(map(str, ids))))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class ValidityRule:
    """A fitted rule for one configuration, with its provenance and calibration figures."""

    config_id: str
    min_tail: float
    min_neff: float
    max_weight: float | None
    salt: str
    fraction: float
    calibration_ids: tuple[str, ...]
    calibration_hash: str
    coverage_column: str
    nominal: float
    calibration_coverage: float
    calibration_certified: float
    calibration_rows: int
    reached: bool

    def mask(self, df: pd.DataFrame) -> np.ndarray:
        """Boolean mask of the rows of ``df`` the rule certifies (NaN inputs fail)."""
        ok = (df["tail_size"].to_numpy(float) >= self.min_tail) & (
            df["n_eff"].to_numpy(float) >= self.min_neff)
        if self.max_weight is not None:
            ok &= df["max_tail_weight"].to_numpy(float) <= self.max_weight
        return ok

    def describe(self) -> str:
        w = "" if self.max_weight is None else f", max_tail_weight <= {self.max_weight:g}"
        return f"m >= {self.min_tail:g}, n_eff >= {self.min_neff:g}{w}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["calibration_ids"] = list(self.calibration_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ValidityRule:
        d = dict(d)
        d["calibration_ids"] = tuple(d["calibration_ids"])
        return cls(**d)


def _calibration_rows(df: pd.DataFrame, settings: SplitSettings) -> tuple[pd.DataFrame, list]:
    split = split_sequences(df["sequence_id"].unique(), settings.salt, settings.fraction)
    calib = sorted(s for s, c in split.items() if c)
    return df[as_text(df["sequence_id"]).isin(calib)], calib


def fit_rule(df: pd.DataFrame, settings: SplitSettings, config_id: str = "*") -> ValidityRule:
    """Fit one rule on the calibration sequences of ``df`` (the rows of one configuration).

    Held-out rows in ``df`` are dropped before anything is computed; see the module docstring
    for the selection rule.
    """
    cal, calib_ids = _calibration_rows(df, settings)
    cal = cal[cal[settings.coverage_column].notna()]
    if cal.empty:
        raise ValueError(f"{config_id}: no calibration rows with {settings.coverage_column}")
    has_w = "max_tail_weight" in cal and cal["max_tail_weight"].notna().any()
    m = cal["tail_size"].to_numpy(float)
    neff = cal["n_eff"].to_numpy(float)
    w = cal["max_tail_weight"].to_numpy(float) if has_w else None
    y = cal[settings.coverage_column].to_numpy(float)
    _, seq = np.unique(as_text(cal["sequence_id"]).to_numpy(), return_inverse=True)
    weights = settings.grid["max_weight"] if has_w else [None]

    def candidates():
        for mt, ne, mw in itertools.product(settings.grid["min_tail"],
                                            settings.grid["min_neff"], weights):
            ok = (m >= mt) & (neff >= ne)
            if mw is not None:
                ok &= w <= mw
            k = int(ok.sum())
            frac = k / y.size
            if frac < settings.min_certified or k == 0 or np.unique(seq[ok]).size < 2:
                continue
            yield mt, ne, mw, float(y[ok].mean()), frac

    return choose_rule(candidates(), config_id, settings, calib_ids, int(y.size))


def choose_rule(candidates, config_id: str, settings: SplitSettings, calib_ids: list[str],
                n_rows: int) -> ValidityRule:
    """The rule among ``candidates`` — ``(min_tail, min_neff, max_weight, coverage,
    certified share)`` of every grid point that certifies enough rows of two or more
    calibration sequences, in grid order — that reaches the nominal coverage with the largest
    certified share (then the higher coverage); if none reaches it, the highest coverage."""
    best, best_key = None, None
    for mt, ne, mw, cov, frac in candidates:
        reached = cov >= settings.nominal
        key = (reached, frac, cov) if reached else (reached, cov, frac)
        if best_key is None or key > best_key:
            best_key, best = key, (mt, ne, mw, cov, frac)
    if best is None:
        raise ValueError(f"{config_id}: no candidate rule certifies rows of two or more "
                         f"calibration sequences")
    mt, ne, mw, cov, frac = best
    return ValidityRule(config_id=config_id, min_tail=float(mt), min_neff=float(ne),
                        max_weight=None if mw is None else float(mw), salt=settings.salt,
                        fraction=settings.fraction, calibration_ids=tuple(calib_ids),
                        calibration_hash=ids_hash(calib_ids),
                        coverage_column=settings.coverage_column, nominal=settings.nominal,
                        calibration_coverage=cov, calibration_certified=frac,
                        calibration_rows=n_rows, reached=bool(best_key[0]))


def fit_rules(df: pd.DataFrame, settings: SplitSettings) -> tuple[dict[str, ValidityRule],
                                                                  list[str]]:
    """One rule per certified configuration of ``df``; returns (rules, notes)."""
    rules: dict[str, ValidityRule] = {}
    keep = df["certified"].astype(bool) & df["cert2"].notna()
    cert = df if keep.all() else df[keep]  # rows read already certified are not copied
    failed: list[str] = []
    for cid, g in cert.groupby("config_id", sort=True, observed=True):
        try:
            rules[str(cid)] = fit_rule(g, settings, str(cid))
        except ValueError:
            failed.append(str(cid))
    return rules, fit_notes(failed, "max_tail_weight" in df)


def fit_notes(failed: list[str], has_weight_column: bool) -> list[str]:
    """What :func:`fit_rules` says about a fit: the configurations no rule could be fitted
    for, and rules without the weight cap when the results have no ``max_tail_weight``."""
    notes = []
    if failed:
        notes.append(f"no validity rule could be fitted for {len(failed)} configuration(s) "
                     f"(no candidate certifies rows of two or more calibration sequences), "
                     f"e.g. {failed[0]}")
    if not has_weight_column:
        notes.append("results have no max_tail_weight column: rules use m and n_eff only")
    return notes


def check_rules(rules: dict[str, ValidityRule], settings: SplitSettings,
                evaluated_ids) -> None:
    """Refuse rules that must not be evaluated on ``evaluated_ids`` (held-out sequences).

    Raises
    ------
    ValidityRuleError
        Naming the configuration and the offending sequences.
    """
    evaluated = set(map(str, evaluated_ids))
    for cid, rule in rules.items():
        where = f"validity rule for {cid}"
        if rule.salt != settings.salt or not math.isclose(rule.fraction, settings.fraction):
            raise ValidityRuleError(
                f"{where}: fitted with split salt {rule.salt!r}, fraction {rule.fraction}, but "
                f"the pre-registration says salt {settings.salt!r}, fraction {settings.fraction}")
        if ids_hash(rule.calibration_ids) != rule.calibration_hash:
            raise ValidityRuleError(f"{where}: calibration ids do not match the recorded hash "
                                    f"{rule.calibration_hash}; the rule record was altered")
        split = split_sequences(rule.calibration_ids, settings.salt, settings.fraction)
        held = sorted(s for s, c in split.items() if not c)
        overlap = sorted(evaluated & set(rule.calibration_ids))
        if held or overlap:
            bad = held or overlap
            raise ValidityRuleError(
                f"{where}: its threshold was fit on held-out sequences {bad[:5]}"
                f"{' ...' if len(bad) > 5 else ''} ({len(bad)} in all); refit it on the "
                f"pre-registered calibration split only")


def apply_rules(df: pd.DataFrame, rules: dict[str, ValidityRule]) -> np.ndarray:
    """Boolean mask: the row's configuration has a rule and the rule certifies the row."""
    out = np.zeros(len(df), dtype=bool)
    codes = as_text(df["config_id"]).to_numpy()
    for cid, rule in rules.items():
        sel = codes == cid
        if sel.any():
            out[sel] = rule.mask(df[sel])
    return out


def save_rules(path: str | Path, rules: dict[str, ValidityRule],
               settings: SplitSettings) -> None:
    """Write the fitted rules as JSON (atomically)."""
    doc = {"salt": settings.salt, "fraction": settings.fraction, "nominal": settings.nominal,
           "coverage_column": settings.coverage_column,
           "rules": [r.to_dict() for r in rules.values()]}
    atomic_write_bytes(Path(path), json.dumps(doc, indent=1).encode())


def load_rules(path: str | Path) -> dict[str, ValidityRule]:
    """Read rules written by :func:`save_rules` (check them with :func:`check_rules`)."""
    path = Path(path)
    try:
        from tracesim.safeio import read_json

        doc = read_json(path, "validity rule file")
        return {r["config_id"]: ValidityRule.from_dict(r) for r in doc["rules"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValidityRuleError(f"{path}: not a validity rule file: {exc}") from None
