"""Configurations that compute the same thing, and budgets the take-all stratum swallows.

**Designs that ignore the score.** ``bernoulli`` keeps every tail token with the same
probability ``n / N``, and ``poisson`` / ``fixed`` with ``mixture = 1`` do the same: the score's
values never reach the inclusion probabilities. A design says so itself, with
``uses_scores = False`` (:class:`~tracesim.designs.Design`; plugins included). Two policies
that differ only in their score then keep the same tokens with the same probabilities and give
identical rows, *provided* everything else a score decides is equal:

- the take-all stratum (``sinks``, ``window``; scores overriding ``take_all`` or
  ``tail_budgets`` are never merged),
- ``top_fraction = 0`` (a positive one keeps the top-scored tail tokens),
- the compressed range (``compress_end``; e.g. question-agnostic SnapKV stops at the question),
- the budget rule (``kept_tokens``; the kvpress presses truncate where tracesim rounds),
- the allocator does not read scores (``adakv`` does),
- the resolved correction (``auto`` gives ``none`` for ``random`` and ``keyformer``).

:func:`merge_score_free` keeps the first such policy of each group (spec order), drops the
others and says so. The report labels these rows by their design alone
(``bernoulli (any score)``).

**Budgets below the take-all stratum.** A budget smaller than ``sinks + window`` tokens leaves
no tail budget: only the take-all stratum is kept, and the effective budget is
``min(context, sinks + window)`` tokens whatever the nominal one (``tracesim.replay.inclusion``
takes ``max(0, B - take_all)`` as the tail budget). :func:`budget_warnings` names them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from types import SimpleNamespace

from tracesim.designs import Design
from tracesim.policies.base import Score
from tracesim.policies.policy import Policy

__all__ = ["budget_warnings", "design_ignores_score", "effective_key", "merge_score_free"]

# Probe lengths for compress_end: distinct primes, so the answer says which boundary it used.
_PROMPT, _QUESTION = 1_000_003, 500_009


def design_ignores_score(design: Design | None) -> bool:
    """Whether the design's inclusion probabilities do not depend on the score's values
    (its ``uses_scores`` is False)."""
    return design is not None and not design.uses_scores


def _compress_boundary(score: Score) -> str | None:
    """Which boundary ``compress_end`` uses ("prompt", "question"), or None if unknown."""
    if type(score).compress_end is Score.compress_end:
        return "prompt"
    probe = SimpleNamespace(prompt_length=_PROMPT, question_start=_QUESTION)
    try:
        end = int(score.compress_end(probe))  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a score reading more than lengths is never merged
        return None
    return {_PROMPT: "prompt", _QUESTION: "question"}.get(end)


def effective_key(policy: Policy) -> str:
    """``policy.id``, or for a policy whose score cannot matter, an id without the score."""
    score, design, budget = policy.score, policy.design, policy.budget
    if (not score.evicts or not getattr(score, "deployable", True)
            or not design_ignores_score(design) or float(score.top_fraction) != 0
            or budget is None or budget.allocator == "adakv"
            or type(score).take_all is not Score.take_all
            or type(score).tail_budgets is not Score.tail_budgets):
        return policy.id
    boundary = _compress_boundary(score)
    if boundary is None:
        return policy.id
    parts = policy.id.split("|")
    # A score with its own budget rule (the kvpress presses truncate) keeps other token counts.
    rule = ("" if type(score).kept_tokens is Score.kept_tokens
            else f",kept={type(score).kept_tokens.__qualname__}")
    parts[0] = (f"any-score(sinks={score.sinks},window={score.window},compress={boundary}"
                f"{rule})")
    return "|".join(parts)


def merge_score_free(policies: Iterable[Policy]) -> tuple[list[Policy], list[str]]:
    """Drop policies equal to an earlier one up to a score the design ignores.

    Returns
    -------
    (policies, notes)
        The kept policies in their original order, and one note per merged group naming the
        design, the kept score and the dropped ones.
    """
    kept: dict[str, Policy] = {}
    dropped: dict[str, list[str]] = {}
    for p in policies:
        key = effective_key(p)
        if key in kept:
            if p.id != kept[key].id and p.score.name not in dropped.setdefault(key, []):
                dropped[key].append(p.score.name)
            continue
        kept[key] = p
    notes = []
    for key, names in dropped.items():
        if not names:
            continue
        p = kept[key]
        notes.append(f"{p.design.name} ignores the score: {', '.join(names)} x "
                     f"{'|'.join(p.id.split('|')[1:])} computed once, as {p.score.name} "
                     f"(same sinks={p.score.sinks}, window={p.score.window}, correction "
                     f"{p.correction})")
    return list(kept.values()), notes


def budget_warnings(policies: Iterable[Policy],
                    contexts: Sequence[int] | None = None) -> list[str]:
    """Warnings for budgets below ``sinks + window`` (the take-all stratum).

    Parameters
    ----------
    policies : iterable of Policy
    contexts : sequence of int, optional
        Lengths (tokens) of the compressible ranges, e.g. the prompt lengths of a store. Token
        budgets are checked without them; fraction budgets only with them (at the shortest).

    Returns
    -------
    list of str
        One line per (budget, sinks, window) below the stratum, naming the scores and the
        effective budget in tokens.
    """
    shortest = min(contexts) if contexts else None
    groups: dict[tuple[str, int, int], list[str]] = {}
    effective: dict[tuple[str, int, int], tuple[int, int]] = {}
    for p in policies:
        if not p.score.evicts or p.budget is None or p.score.truncate_stratum:
            continue
        stratum = int(p.score.sinks) + int(p.score.window)
        if p.budget.unit == "tokens":
            ctx = shortest
            nominal = (int(p.budget.value) if ctx is None
                       else p.score.kept_tokens(p.budget, ctx))
        elif shortest is not None:
            ctx = shortest
            nominal = p.score.kept_tokens(p.budget, ctx)
        else:
            continue
        floor = stratum if ctx is None else min(ctx, stratum)
        if nominal >= floor:
            continue
        key = (p.budget.label(), int(p.score.sinks), int(p.score.window))
        if p.score.name not in groups.setdefault(key, []):
            groups[key].append(p.score.name)
        effective[key] = (nominal, floor)
    out = []
    for (label, sinks, window), names in groups.items():
        nominal, floor = effective[(label, sinks, window)]
        where = "" if shortest is None else f" at the shortest context ({shortest} tokens)"
        out.append(f"budget {label} is {nominal} token(s){where}, below sinks + window = "
                   f"{sinks} + {window} of {', '.join(names)}: the effective budget is {floor} "
                   "tokens (only sinks and window are kept; nothing is sampled)")
    return out
