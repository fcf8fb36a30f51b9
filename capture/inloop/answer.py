"""Answer-span diagnostics of the in-loop runs: how much of the gold answer each policy kept.

For a generated task (:mod:`tracesim.capture.tasks`) the gold answer is a number written inside the
needle sentence(s) of the context. :func:`locate_answer` finds the prompt tokens that carry its
digits, from the stored token ids alone (the trace format is unchanged), and the outcome rows
then say, per (layer, KV head), what share of those tokens the configuration attended
(:func:`answer_columns`, ``docs/evict.md``, "Why accuracy dropped").

Rule for the span. Every context token is decoded on its own and the pieces are concatenated
into a text with known character offsets per token. Every occurrence of the gold digits as a
whole number in that text (no digit right before or after it) is an occurrence of the answer;
its tokens are those whose characters overlap it. An occurrence counts only if decoding its
tokens together with one neighbour on each side again shows the gold as a whole number, so a
tokenizer whose single-token decoding drops a space cannot join two numbers into a false match.
Every occurrence in the context counts (the passkey needle states its key twice). Sequences of
tasks outside :data:`tracesim.capture.tasks.TASKS`, with a non-numeric or missing gold, or whose
gold is
not found in the context have no span (null columns).

This module imports no torch: it works on numpy arrays of kept masks and inclusion
probabilities.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ANSWER_COLUMNS", "AnswerSpan", "answer_columns", "locate_answer", "plan_masks",
           "sequence_answer"]

#: Outcome columns of the answer span (``docs/columns.md``); null without a span.
ANSWER_COLUMNS = ("answer_tokens", "answer_kept_share", "answer_kept_min",
                  "answer_first_kept_share", "answer_last_kept_share", "answer_pi_mean",
                  "answer_kept_by_head", "answer_pi_by_head")


@dataclass(frozen=True)
class AnswerSpan:
    """Prompt token positions that carry the gold answer's digits.

    Attributes
    ----------
    occurrences : tuple of ndarray of int64
        One array per occurrence of the answer in the context, the positions of its tokens in
        increasing order (first-digit token first).
    """

    occurrences: tuple[np.ndarray, ...]

    @property
    def positions(self) -> np.ndarray:
        """``(n,)`` int64: every span token once, increasing."""
        return np.unique(np.concatenate(self.occurrences))

    @property
    def first(self) -> np.ndarray:
        """``(n_occurrences,)`` int64: the token carrying each occurrence's first digit."""
        return np.array([occ[0] for occ in self.occurrences], dtype=np.int64)

    @property
    def last(self) -> np.ndarray:
        """``(n_occurrences,)`` int64: the token carrying each occurrence's last digit."""
        return np.array([occ[-1] for occ in self.occurrences], dtype=np.int64)


def _whole_number(gold: str) -> re.Pattern[str]:
    # ASCII digits only: the gold answers are ASCII, and "\d" would also match other scripts.
    return re.compile(rf"(?<![0-9]){re.escape(gold)}(?![0-9])")


def locate_answer(token_ids: Sequence[int], context_start: int, context_end: int,
                  gold: str | None, task: str | None, tokenizer: Any) -> AnswerSpan | None:
    """The answer span of a prompt (module docstring: the rule), or None where it is unknown.

    Parameters
    ----------
    token_ids : sequence of int
        The prompt's token ids (at least ``context_end`` of them).
    context_start, context_end : int
        Token positions of the context, ``token_ids[context_start:context_end]``.
    gold : str or None
        The gold answer.
    task : str or None
        The task; only the generated tasks (:data:`tracesim.capture.tasks.TASKS`) have a span.
    tokenizer : transformers tokenizer or None

    Returns
    -------
    AnswerSpan or None
        Positions are prompt token positions (``context_start`` and up).
    """
    from tracesim.capture.tasks import TASKS

    if (tokenizer is None or task not in TASKS or not gold or not gold.isascii()
            or not gold.isdigit()):
        return None
    cs, ce = int(context_start), int(context_end)
    ids = [int(t) for t in token_ids[cs:ce]]
    if not ids:
        return None
    decode = dict(skip_special_tokens=False, clean_up_tokenization_spaces=False)
    pieces = tokenizer.batch_decode([[t] for t in ids], **decode)
    ends = np.cumsum([len(p) for p in pieces])
    starts = ends - np.array([len(p) for p in pieces])
    pattern = _whole_number(gold)
    occurrences = []
    for match in pattern.finditer("".join(pieces)):
        a, b = match.span()
        tokens = np.flatnonzero((starts < b) & (ends > a))
        lo, hi = int(tokens[0]), int(tokens[-1])
        if not pattern.search(tokenizer.decode(ids[max(lo - 1, 0):hi + 2], **decode)):
            continue  # the pieces joined what the real decoding keeps apart
        occurrences.append((tokens + cs).astype(np.int64))
    return AnswerSpan(tuple(occurrences)) if occurrences else None


def sequence_answer(meta: Mapping[str, Any], tokenizer: Any) -> AnswerSpan | None:
    """:func:`locate_answer` of a trace store sequence (its ``meta``), None where unknown."""
    return locate_answer(list(meta["token_ids"]), int(meta["context_start"]),
                         int(meta["context_end"]), meta.get("gold"), meta.get("task"),
                         tokenizer)


def plan_masks(history: Sequence[tuple[int, Mapping[int, Any]]], n_generated: int,
               prompt_length: int, n_layers: int, n_kv: int, positions: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """Kept flags and inclusion probabilities of the span tokens under one-shot or decode-time
    plans, per decode step.

    Parameters
    ----------
    history : sequence of (tau, {layer: LayerPlan})
        The events of the run (the first at the end of prefill); a layer without a plan
        attends to everything (kept, pi = 1).
    n_generated : int
        Generated tokens; the decode steps sit at ``prompt_length .. prompt_length +
        n_generated - 2`` (the first token comes from the full-cache prefill). Without a
        decode step the first event's plans stand for the run.
    prompt_length, n_layers, n_kv : int
    positions : ndarray of int64, shape (n,)
        The span's prompt positions.

    Returns
    -------
    kept : ndarray of bool, shape (S, n_layers, n_kv, n)
    pi : ndarray of float64, shape (S, n_layers, n_kv, n)
        ``S`` is the number of decode steps (at least 1); a one-shot run's steps all read its
        single plan.
    """
    taus = np.array([tau for tau, _ in history])
    n_steps = max(n_generated - 1, 1)
    if len(history) == 1:
        n_steps = 1  # one plan in force at every step: its flags stand for each of them
    kept = np.ones((n_steps, n_layers, n_kv, positions.size), dtype=bool)
    pi = np.ones(kept.shape)
    for s in range(n_steps):
        t = prompt_length + s
        _, plans = history[max(int(np.searchsorted(taus, t, side="right")) - 1, 0)]
        for layer, plan in plans.items():
            kept[s, layer] = plan.kept[:, positions].numpy()
            pi[s, layer] = plan.pi[:, positions].numpy()
    return kept, pi


def _share(flags: np.ndarray) -> float:
    return float(flags.mean()) if flags.size else math.nan


def answer_columns(span: AnswerSpan | None, kept: np.ndarray | None, pi: np.ndarray | None
                   ) -> dict[str, Any]:
    """The :data:`ANSWER_COLUMNS` of one run.

    Parameters
    ----------
    span : AnswerSpan or None
        None (no span) gives nulls everywhere.
    kept : ndarray of bool, shape (S, n_layers, n_kv, n), or None
        Whether each span token (in ``span.positions`` order) is attended at each decode step,
        layer and KV head; None (no decode step was observed) gives null shares.
    pi : ndarray of float64, same shape, or None
        Inclusion probabilities of a randomized design; None elsewhere.

    Returns
    -------
    dict
        ``answer_tokens`` (span size), ``answer_kept_share`` (mean over steps, layers, KV
        heads and span tokens), ``answer_kept_min`` (smallest per-(layer, KV head) share, each
        a mean over steps), ``answer_first_kept_share`` / ``answer_last_kept_share`` (the same
        mean over the tokens of each occurrence's first / last digit), ``answer_pi_mean``,
        and the per-(layer, KV head) lists ``answer_kept_by_head`` / ``answer_pi_by_head``
        (layer-major, ``n_layers x n_kv`` entries, means over steps and span tokens). NaN and
        empty lists are the in-memory nulls (:func:`tracesim.columns.nullify_rows`).
    """
    nan = math.nan
    row: dict[str, Any] = {"answer_tokens": None if span is None else int(span.positions.size),
                           "answer_kept_share": nan, "answer_kept_min": nan,
                           "answer_first_kept_share": nan, "answer_last_kept_share": nan,
                           "answer_pi_mean": nan, "answer_kept_by_head": [],
                           "answer_pi_by_head": []}
    if span is None or kept is None or kept.shape[0] == 0:
        return row
    by_head = kept.mean(axis=(0, 3))  # (n_layers, n_kv)
    index = {int(p): i for i, p in enumerate(span.positions)}
    first = [index[int(p)] for p in span.first]
    last = [index[int(p)] for p in span.last]
    row.update(answer_kept_share=_share(kept), answer_kept_min=float(by_head.min()),
               answer_first_kept_share=_share(kept[..., first]),
               answer_last_kept_share=_share(kept[..., last]),
               answer_kept_by_head=by_head.ravel().tolist())
    if pi is not None:
        row.update(answer_pi_mean=float(pi.mean()),
                   answer_pi_by_head=pi.mean(axis=(0, 3)).ravel().tolist())
    return row
