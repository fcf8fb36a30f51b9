"""Eviction policies as score × design × correction (+ budget and schedule).

=============  ====================================================  ======================
score          rule                                                  non-negative transform
=============  ====================================================  ======================
``streaming``  position only: sinks + most recent                    ``position + 1``
``h2o``        accumulated prefill attention (+ decode steps)        mass, as is
``snapkv``     window queries' attention, pooled (k=5, avg/max)      mass, as is
``tova``       the last query's attention, mean over the group       mass, as is
``knorm``      ``-‖k‖`` (small key norm = important)                 ``exp(-(‖k‖-min)/tau)``
``vnorm``      largest ``‖v‖`` take-all, design over the rest        ``‖v‖``, as is
``vase``       VaSE: ‖v‖ guard + Gumbel-perturbed base score          ``base · exp(tau g)``
``headroles``  retrieval heads: the budget; streaming: sinks+window  the base score, as is
``tangram``    fixed per-head budgets from a calibrated profile      the base score, as is
``keyformer``  Gumbel-perturbed accumulated attention                ``h2o · exp(tau g)``
``random``     uniform noise (naive baseline, uncorrected)           ``u`` in (0, 1)
``oracle``     the decode queries' own attention (not deployable)    mass, as is
``perstep``    a proxy of each step's own query (schedule ``step``)  proxy mass, as is
``full``       no eviction (the reference)                           —
=============  ====================================================  ======================

The kvpress ports (``keydiff``, ``lagkv``, ``cur``, ``expected_attention``) and the kvpress
presses by class name (``SnapKVPress``, ``KnormPress``, ...: kvpress's own kept set, with its
truncated budget and earlier-token ties) are in :mod:`tracesim.policies.kvpress`.

Build policies with :func:`make_policy` (or :class:`Policy` directly) and grids with
:func:`policy_grid`.
"""

from __future__ import annotations

from typing import Any

from tracesim.budgets import Budget
from tracesim.designs import Design, make_design
from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score, take_all_mask
from tracesim.policies.full import FullScore
from tracesim.policies.h2o import H2OScore
from tracesim.policies.headroles import HeadRolesScore
from tracesim.policies.keyformer import KeyformerScore
from tracesim.policies.knorm import KNormScore
from tracesim.policies.kvpress import KVPRESS_ALIASES, KVPRESS_SCORES
from tracesim.policies.oracle import OracleScore
from tracesim.policies.perstep import PerStepScore
from tracesim.policies.policy import CORRECTIONS, POLICY_COLUMNS, Policy
from tracesim.policies.redundancy import merge_score_free
from tracesim.policies.snapkv import SnapKVScore
from tracesim.policies.streaming import StreamingScore
from tracesim.policies.tangram import TangramScore
from tracesim.policies.tova import TOVAScore
from tracesim.policies.uniform import RandomScore
from tracesim.policies.vase import VaSEScore
from tracesim.policies.vnorm import VNormScore
from tracesim.registry import SCORE_REGISTRY
from tracesim.schedules import Schedule

__all__ = [
    "CORRECTIONS", "POLICY_COLUMNS", "SCORES", "FullScore", "H2OScore", "HeadRolesScore",
    "KNormScore", "TangramScore", "VaSEScore",
    "KeyformerScore", "LayerTrace", "OracleScore", "PerStepScore", "Policy", "RandomScore",
    "Score", "SnapKVScore", "StreamingScore", "TOVAScore", "VNormScore", "make_policy",
    "make_score", "policy_grid",
    "take_all_mask", "SCORE_REGISTRY",
]

SCORES: dict[str, type[Score]] = {cls.name: cls for cls in (
    StreamingScore, H2OScore, SnapKVScore, TOVAScore, KNormScore, VNormScore, KeyformerScore,
    RandomScore, OracleScore, PerStepScore, FullScore, VaSEScore, HeadRolesScore,
    TangramScore)}
SCORES.update(KVPRESS_SCORES)
#: Built-ins + kvpress aliases + plugins (entry points ``tracesim.scores``, decorator); see
#: tracesim.registry.
SCORE_REGISTRY.install(SCORES, Score)
SCORE_REGISTRY.aliases.update(KVPRESS_ALIASES)


def make_score(name: str, **params: Any) -> Score:
    """Build a score from its registry name (or a kvpress alias, or a plugin's name)."""
    return SCORE_REGISTRY.build(name, params)


def make_policy(
    score: str | Score,
    design: str | Design = "topk",
    budget: float | Budget = 0.25,
    *,
    correction: str = "auto",
    schedule: str | Schedule = "oneshot",
    score_params: dict[str, Any] | None = None,
    design_params: dict[str, Any] | None = None,
    summary_page: int = 0,
) -> Policy:
    """Convenience constructor: ``make_policy("snapkv", "poisson", 0.25)``.

    A float ``budget`` is a fraction if <= 1, else a token count; a ``schedule`` string is
    ``"oneshot"``, ``"decode"`` / ``"decode:K"`` (every K steps) or ``"step"`` /
    ``"step:permanent"`` (per-step designs, fresh or permanent uniforms); ``summary_page`` is the
    page size of the missing-token summaries (0 = none, see :class:`Policy`).
    """
    if isinstance(score, str):
        score = make_score(score, **(score_params or {}))
    if isinstance(design, str):
        design = make_design(design, **(design_params or {}))
    if not isinstance(budget, Budget):
        value = float(budget)
        budget = Budget(value) if value <= 1.0 else Budget(int(value), unit="tokens")
    if isinstance(schedule, str):
        kind, _, every = schedule.partition(":")
        if kind == "step":
            schedule = Schedule("step", coordination=every or "fresh")
        else:
            schedule = Schedule(kind, int(every)) if every else Schedule(kind)
    return Policy(score=score, design=design, correction=correction, budget=budget,
                  schedule=schedule, summary_page=summary_page)


def policy_grid(
    scores: list[str], designs: list[str], budgets: list[float], *,
    correction: str = "auto", schedule: str | Schedule = "oneshot",
    allocator: str = "uniform", design_params: dict[str, dict[str, Any]] | None = None,
    score_params: dict[str, dict[str, Any]] | None = None, summary_page: int = 0,
    merge: bool = True,
) -> list[Policy]:
    """Every score × design × budget combination (``full`` once), deduplicated by id and by
    :func:`~tracesim.policies.redundancy.merge_score_free` (a score the design ignores).

    A budget is a float (a fraction if <= 1, else tokens) or a ``(value, unit)`` pair.
    """
    out: dict[str, Policy] = {}
    for s in scores:
        for dname in designs:
            for b in budgets:
                if isinstance(b, tuple):
                    value, unit = float(b[0]), str(b[1])
                else:
                    value = float(b)
                    unit = "fraction" if value <= 1 else "tokens"
                budget = Budget(value, unit, allocator)
                p = make_policy(s, dname, budget, correction=correction, schedule=schedule,
                                score_params=(score_params or {}).get(s),
                                design_params=(design_params or {}).get(dname),
                                summary_page=summary_page)
                out.setdefault(p.id, p)
    return merge_score_free(out.values())[0] if merge else list(out.values())
