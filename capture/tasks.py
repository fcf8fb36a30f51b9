"""Generated RULER-style long-context tasks with exact graders.

Four tasks, each a retrieval the full-cache model can do at short lengths and starts to miss as
the haystack grows:

``passkey``
    A 5-digit pass key hidden in repetitive filler ("The grass is green. ...").
``multikey``
    Several "special magic numbers" for word-pair keys hidden in prose; the question names one key.
    The others are distractors with different numbers.
``vartrack``
    Variable tracking: ``VAR ABCDE = 12345.`` followed later by hops ``VAR FGHIJ = VAR ABCDE.``;
    distractor chains carry other values; the question asks for the value of the chain's last
    variable (multi-hop retrieval).
``kvret``
    Key-value retrieval: the whole context is a list of ``noun: value`` lines (6-digit values,
    distractor keys repeat with fresh values); the question asks for the value of the one key
    that appears once.

Every instance is a pure function of ``(task, length, seed, depth)``: Python's ``random.Random``
seeded with an integer. Lengths are in tokens of the given tokenizer: haystack pieces are added
until the rendered prompt would exceed ``length``. The prompt is the concatenation of separately
tokenized pieces (template head + instruction, context pieces, separator, question, template tail +
answer prefix), so context and question boundaries are exact token positions.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tracesim.capture.haystack import ADJECTIVES, NOUNS, PASSKEY_NOISE, SENTENCES

TASKS: tuple[str, ...] = ("passkey", "multikey", "vartrack", "kvret")


@dataclass(frozen=True)
class TaskSpec:
    """A task instance before it is fitted to a length: text pieces and the gold answer."""

    instruction: str
    question: str
    answer_prefix: str
    gold: str
    needles: list[str]
    needle_depths: list[float]
    filler: Callable[[random.Random], str]
    separator: str
    max_new_tokens: int


@dataclass(frozen=True)
class TaskPrompt:
    """A rendered, tokenized task instance.

    Attributes
    ----------
    task, length, seed, depth : str, int, int, float
        What generated it (``seed`` is the instance seed, see :func:`instance_seed`).
    token_ids : list of int
        ``(prompt_length,)`` prompt token ids.
    context_start, context_end, question_start, question_end, prompt_length : int
        Token positions: ``token_ids[context_start:context_end]`` is the context,
        ``token_ids[question_start:question_end]`` the question.
    context, question, answer_prefix, gold : str
        The texts and the gold answer.
    max_new_tokens : int
        Generation budget the task needs.
    """

    task: str
    length: int
    seed: int
    depth: float
    token_ids: list[int]
    context_start: int
    context_end: int
    question_start: int
    question_end: int
    prompt_length: int
    context: str
    question: str
    answer_prefix: str
    gold: str
    max_new_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)


def instance_seed(task: str, length: int, seed: int, index: int) -> int:
    """Deterministic 63-bit seed of the ``index``-th instance of a capture run."""
    digest = hashlib.sha256(f"{task}|{length}|{seed}|{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _distinct(rng: random.Random, make: Callable[[], str], n: int) -> list[str]:
    seen: list[str] = []
    while len(seen) < n:
        item = make()
        if item not in seen:
            seen.append(item)
    return seen


def _word_key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _var_name(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def _prose(rng: random.Random) -> str:
    return rng.choice(SENTENCES)


def _spec_passkey(rng: random.Random, depth: float) -> TaskSpec:
    key = _number(rng, 5)
    return TaskSpec(
        instruction="There is an important info hidden inside a lot of irrelevant text. "
        "Find it and memorize it. I will quiz you about the important information there.",
        question="What is the pass key?",
        answer_prefix="The pass key is",
        gold=key,
        needles=[f"The pass key is {key}. Remember it. {key} is the pass key."],
        needle_depths=[depth],
        filler=lambda r: PASSKEY_NOISE,
        separator=" ",
        max_new_tokens=10,
    )


def _spec_multikey(rng: random.Random, depth: float, n_keys: int = 3) -> TaskSpec:
    keys = _distinct(rng, lambda: _word_key(rng), n_keys)
    values = _distinct(rng, lambda: _number(rng, 6), n_keys)
    depths = [depth] + [rng.random() for _ in range(n_keys - 1)]
    return TaskSpec(
        instruction="Some special magic numbers are hidden within the following text. "
        "Make sure to memorize it. I will quiz you about the numbers afterwards.",
        question=f"What is the special magic number for {keys[0]} mentioned in the provided text?",
        answer_prefix=f"The special magic number for {keys[0]} mentioned in the provided text is",
        gold=values[0],
        needles=[
            f"One of the special magic numbers for {k} is: {v}."
            for k, v in zip(keys, values, strict=True)
        ],
        needle_depths=depths,
        filler=_prose,
        separator=" ",
        max_new_tokens=12,
    )


def _spec_vartrack(
    rng: random.Random, depth: float, n_hops: int = 1, n_distractors: int = 1
) -> TaskSpec:
    n_chains = 1 + n_distractors
    names = _distinct(rng, lambda: _var_name(rng), n_chains * (n_hops + 1))
    chains = [names[c * (n_hops + 1) : (c + 1) * (n_hops + 1)] for c in range(n_chains)]
    values = _distinct(rng, lambda: _number(rng, 5), n_chains)
    starts = [depth] + [rng.random() * 0.5 for _ in range(n_distractors)]
    stmts, depths = [], []
    for chain, value, start in zip(chains, values, starts, strict=True):
        # Each hop comes after the assignment it copies, so the chain reads forward.
        hop_depths = sorted(start + (1 - start) * rng.random() for _ in range(n_hops))
        stmts.append(f"VAR {chain[0]} = {value}.")
        depths.append(start)
        for prev, cur, d in zip(chain[:-1], chain[1:], hop_depths, strict=True):
            stmts.append(f"VAR {cur} = VAR {prev}.")
            depths.append(d)
    target = chains[0][-1]
    return TaskSpec(
        instruction="Memorize and track the chain(s) of variable assignment hidden in the "
        "following text.",
        question=f"What is the value of VAR {target}?",
        answer_prefix=f"The value of VAR {target} is",
        gold=values[0],
        needles=stmts,
        needle_depths=depths,
        filler=_prose,
        separator=" ",
        max_new_tokens=10,
    )


def _spec_kvret(rng: random.Random, depth: float) -> TaskSpec:
    keys = list(NOUNS)
    rng.shuffle(keys)
    key, others = keys[0], keys[1:]
    value = _number(rng, 6)
    # Distractor keys cycle through the other nouns (each visit with a fresh value); the asked
    # key appears exactly once.
    counter = iter(range(10**9))

    def filler(r: random.Random) -> str:
        return f"{others[next(counter) % len(others)]}: {_number(r, 6)}"

    return TaskSpec(
        instruction="Below is a list of keys, each followed by its value. Memorize them. "
        "I will ask you for the value of one key.",
        question=f"What is the value of the key {key}?",
        answer_prefix=f"The value of the key {key} is",
        gold=value,
        needles=[f"{key}: {value}"],
        needle_depths=[depth],
        filler=filler,
        separator="\n",
        max_new_tokens=12,
    )


_SPECS: dict[str, Callable[..., TaskSpec]] = {
    "passkey": _spec_passkey,
    "multikey": _spec_multikey,
    "vartrack": _spec_vartrack,
    "kvret": _spec_kvret,
}

_CTX, _Q = "\x00CONTEXT\x00", "\x00QUESTION\x00"


def _template_pieces(tokenizer: Any, instruction: str,
                     chat_template: bool = True) -> tuple[str, str, str]:
    """Split the chat template around the context and question: (head, middle, tail)."""
    user = f"{instruction}\n\n{_CTX}\n\n{_Q}"
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = f"{user}\n\n"
    head, rest = text.split(_CTX)
    middle, tail = rest.split(_Q)
    return head, middle, tail


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def special_prefix(tokenizer: Any) -> list[int]:
    """Tokens the tokenizer puts before any text (BOS for Llama- and Gemma-style tokenizers)."""
    ids = list(tokenizer.encode("x", add_special_tokens=True))
    bare = list(tokenizer.encode("x", add_special_tokens=False))
    n = len(ids) - len(bare)
    return ids[:n] if n > 0 and ids[n:n + len(bare)] == bare else []


def build_prompt(
    tokenizer: Any, task: str, length: int, seed: int, depth: float | None = None,
    chat_template: bool = True, **params: Any
) -> TaskPrompt:
    """Generate one task instance and render it to about ``length`` prompt tokens.

    Parameters
    ----------
    tokenizer : transformers tokenizer
        Used for the chat template and to count tokens.
    task : str
        One of :data:`TASKS`.
    length : int
        Target prompt length in tokens; the prompt is the longest fill not exceeding it.
    seed : int
        Instance seed; everything (values, keys, filler, default depth) derives from it.
    depth : float, optional
        Relative position of the (gold) needle in the context, in [0, 1]; drawn from the seed if
        None.
    chat_template : bool, default True
        Render with the tokenizer's chat template (if it has one); False uses the plain text.
    **params
        Task options (``n_keys`` for multikey, ``n_hops`` and ``n_distractors`` for vartrack).

    Returns
    -------
    TaskPrompt
    """
    if task not in _SPECS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    rng = random.Random(seed)
    if depth is None:
        depth = round(rng.uniform(0.05, 0.95), 3)
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    spec = _SPECS[task](rng, depth, **params)
    head, middle, tail = _template_pieces(tokenizer, spec.instruction, chat_template)
    head_ids, mid_ids = _encode(tokenizer, head), _encode(tokenizer, middle)
    if not (chat_template and getattr(tokenizer, "chat_template", None)):
        # Plain text (a base model such as Gemma 3 270M): the tokenizer's BOS, as the model was
        # trained with; a chat template writes its own.
        head_ids = special_prefix(tokenizer) + head_ids
    q_ids = _encode(tokenizer, spec.question)
    tail_ids = _encode(tokenizer, tail + spec.answer_prefix)
    sep = spec.separator
    needle_ids = [_encode(tokenizer, sep + n) for n in spec.needles]
    budget = length - len(head_ids) - len(mid_ids) - len(q_ids) - len(tail_ids)
    budget -= sum(len(ids) for ids in needle_ids)
    fillers: list[tuple[str, list[int]]] = []
    while True:
        text = sep + spec.filler(rng)
        ids = _encode(tokenizer, text)
        if len(ids) > budget:
            break
        fillers.append((text, ids))
        budget -= len(ids)
    if budget < 0:
        raise ValueError(f"length {length} is too short for a {task} prompt")
    # Needles go between filler pieces at their depth; ties keep the needle order.
    slots = sorted(
        range(len(spec.needles)), key=lambda i: (round(spec.needle_depths[i] * len(fillers)), i)
    )
    pieces: list[tuple[str, list[int]]] = []
    j = 0
    for i in slots:
        stop = round(spec.needle_depths[i] * len(fillers))
        pieces.extend(fillers[j:stop])
        j = max(j, stop)
        pieces.append((sep + spec.needles[i], needle_ids[i]))
    pieces.extend(fillers[j:])
    # The first piece goes right after the template's "\n\n": drop its separator.
    first_text = pieces[0][0][len(sep) :]
    pieces[0] = (first_text, _encode(tokenizer, first_text))
    context = "".join(t for t, _ in pieces)
    ctx_ids = [t for _, ids in pieces for t in ids]
    token_ids = head_ids + ctx_ids + mid_ids + q_ids + tail_ids
    cs = len(head_ids)
    ce = cs + len(ctx_ids)
    qs = ce + len(mid_ids)
    qe = qs + len(q_ids)
    return TaskPrompt(
        task=task,
        length=length,
        seed=seed,
        depth=float(depth),
        token_ids=token_ids,
        context_start=cs,
        context_end=ce,
        question_start=qs,
        question_end=qe,
        prompt_length=len(token_ids),
        context=context,
        question=spec.question,
        answer_prefix=spec.answer_prefix,
        gold=spec.gold,
        max_new_tokens=spec.max_new_tokens,
        meta=dict(params),
    )


_NUMBER = re.compile(r"\d+")


def grade(task: str, answer: str, gold: str) -> bool:
    """Exact grading of a generated continuation (the text after the answer prefix).

    Every task's answer is a number: correct iff the first run of digits in ``answer`` equals
    ``gold`` (so "12345." and " 12345, remember" pass, "1234" and "123456" fail).
    """
    if task in _SPECS:
        match = _NUMBER.search(answer)
        return match is not None and match.group(0) == gold
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
