"""A policy = score × design × correction, with a budget and a schedule; one replay config."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from tracesim.budgets import Budget
from tracesim.designs import Design
from tracesim.policies.base import Score
from tracesim.registry import DESIGN_REGISTRY, SCORE_REGISTRY
from tracesim.schedules import Schedule

__all__ = ["CORRECTIONS", "Policy", "POLICY_COLUMNS"]

CORRECTIONS = ("none", "hajek")

#: Columns every result row carries (see :meth:`Policy.row`).
POLICY_COLUMNS = (
    "config_id", "score", "design", "correction", "budget", "budget_unit", "allocator",
    "alpha", "beta", "schedule", "every", "sinks", "window", "top_fraction", "mixture",
    "floor", "design_kind", "design_params", "score_params", "certified", "summary_page",
    "deployable",
)


def _design_label(design: Design | None) -> str:
    if design is None:
        return "none"
    params = asdict(design)
    if not params:
        return design.name
    inner = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in params.items())
    return f"{design.name}({inner})"


@dataclass(frozen=True)
class Policy:
    """One replay configuration.

    Parameters
    ----------
    score : Score
    design : Design, optional
        ``None`` only for the ``full`` score (no eviction).
    correction : {"none", "hajek", "auto"}
        ``auto`` takes the score's default (``hajek`` for randomized designs unless the score is
        ``random`` or ``keyformer``, whose naive use is uncorrected; ``none`` for top-k).
    budget : Budget, optional
        Required unless the score is ``full``.
    schedule : Schedule
    summary_page : int, default 0
        Page size (positions) of the summaries retained for the tokens the policy does not
        keep, which give the deterministic ``bound`` (``docs/math.md``, section 9); 0 = none.
        Part of the id only when > 0.

    Notes
    -----
    Certificates are reported only for *certified* policies: a randomized design with the Hájek
    correction. Deterministic designs (top-k), uncorrected estimates and ``full`` get NaN.
    """

    score: Score
    design: Design | None = None
    correction: str = "auto"
    budget: Budget | None = None
    schedule: Schedule = field(default_factory=Schedule)
    summary_page: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.score, Score):
            raise ValueError(f"Policy.score must be a Score, got {type(self.score).__name__}")
        sp = self.summary_page
        if isinstance(sp, bool) or not isinstance(sp, int) or sp < 0:
            raise ValueError(f"Policy.summary_page = {sp!r}: expected an integer page size "
                             f">= 1 (positions per page), or 0 for no summaries")
        if not self.score.evicts:
            object.__setattr__(self, "summary_page", 0)
            # The full cache ignores design, correction and budget: normalise for a stable id.
            object.__setattr__(self, "design", None)
            object.__setattr__(self, "correction", "none")
            object.__setattr__(self, "budget", None)
            return
        if not isinstance(self.design, Design):
            raise ValueError(f"Policy {self.score.name}: a design is required")
        if not isinstance(self.budget, Budget):
            raise ValueError(f"Policy {self.score.name}: a Budget is required")
        self.score.check_budget(self.budget)
        if not isinstance(self.schedule, Schedule):
            raise ValueError("Policy.schedule must be a Schedule")
        correction = self.correction
        if correction == "auto":
            correction = (self.score.default_correction if self.design.randomized else "none")
        if correction not in CORRECTIONS:
            raise ValueError(f"Policy.correction = {self.correction!r}: expected one of "
                             f"{CORRECTIONS + ('auto',)}")
        object.__setattr__(self, "correction", correction)
        if self.design.variance == "fixed" and self.schedule.kind != "oneshot":
            raise ValueError("fixed-size designs support only the one-shot schedule (the nested "
                             "rule u < min pi is a Poisson design, not a fixed-size one)")
        if self.score.per_query_head and not self.schedule.per_step:
            raise ValueError(f"Policy {self.score.name}: gqa = 'head' draws one sample per query "
                             f"head at every decode step; expected schedule 'step' (or "
                             f"'step:permanent'), got {self.schedule.label()!r}")
        if self.schedule.per_step != self.score.per_step:
            raise ValueError(
                f"Policy {self.score.name}: schedule {self.schedule.label()!r} "
                + ("needs a per-step score (perstep: pi from a proxy of each step's query)"
                   if self.schedule.per_step else
                   "is not 'step'; a per-step score redraws its sample at every decode step, "
                   "expected schedule 'step' (or 'step:permanent')"))
        if self.schedule.per_step and self.summary_page:
            raise ValueError("Policy.summary_page: page summaries are not available for per-step "
                             "designs (the whole cache is held in the lower tier); expected 0")

    @property
    def certified(self) -> bool:
        """Whether certificates and coverage are reported (randomized design + Hájek)."""
        return (self.design is not None and self.design.randomized
                and self.correction == "hajek")

    @property
    def needs_seeds(self) -> bool:
        """Whether results vary with the seed (else one seed is replayed and reported)."""
        return self.score.evicts and (self.design.randomized or self.score.seed_dependent)

    @property
    def id(self) -> str:
        """Stable string id: ``score(...)|design(...)|correction|budget|schedule``."""
        if not self.score.evicts:
            return "full"
        parts = (self.score.label(), _design_label(self.design), self.correction,
                 self.budget.label(), self.schedule.label())
        return "|".join(parts + ((f"pages={self.summary_page}",) if self.summary_page else ()))

    def row(self) -> dict[str, Any]:
        """The configuration as Parquet columns (:data:`POLICY_COLUMNS`, fixed types)."""
        d = asdict(self.design) if self.design is not None else {}
        b = self.budget
        return {
            "config_id": self.id,
            "score": self.score.name,
            "design": self.design.name if self.design is not None else "none",
            "correction": self.correction,
            "budget": float(b.value) if b else math.nan,
            "budget_unit": b.unit if b else "",
            "allocator": b.allocator if b else "",
            "alpha": float(b.alpha) if b and b.allocator == "adakv" else math.nan,
            "beta": float(b.beta) if b and b.allocator == "pyramidkv" else math.nan,
            "schedule": self.schedule.kind,
            "every": int(self.schedule.every) if self.schedule.kind == "decode" else 0,
            "sinks": int(self.score.sinks),
            "window": int(self.score.window),
            "top_fraction": float(self.score.top_fraction),
            "mixture": float(d.get("mixture", math.nan)),
            "floor": float(d.get("floor", math.nan)),
            "design_kind": str(d.get("kind", "")),
            # Every design's hyperparameters, plugins included ("" -> null for full).
            "design_params": self.design.params_json() if self.design is not None else "",
            "score_params": self.score.specific_params_json(),
            "certified": self.certified,
            "summary_page": int(self.summary_page),
            "deployable": bool(self.score.deployable),
        }

    def to_json(self) -> str:
        """JSON description (no pickle anywhere) that :meth:`from_dict` reads back."""
        extra = {"summary_page": self.summary_page} if self.summary_page else {}
        return json.dumps({
            **extra,
            "score": {"name": self.score.name, **self.score.params()},
            "design": None if self.design is None else {"name": self.design.name,
                                                        **asdict(self.design)},
            "correction": self.correction,
            "budget": None if self.budget is None else asdict(self.budget),
            "schedule": self.schedule.params(),
        }, sort_keys=True)

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> Policy:
        """Build a policy from the dict form of :meth:`to_json`."""
        score_spec = dict(spec["score"])
        score = SCORE_REGISTRY.build(score_spec.pop("name"), score_spec)
        design = None
        if spec.get("design"):
            design_spec = dict(spec["design"])
            design = DESIGN_REGISTRY.build(design_spec.pop("name"), design_spec)
        budget = Budget(**spec["budget"]) if spec.get("budget") else None
        schedule = Schedule(**spec.get("schedule", {}))
        return cls(score=score, design=design, correction=spec.get("correction", "auto"),
                   budget=budget, schedule=schedule,
                   summary_page=spec.get("summary_page", 0))


