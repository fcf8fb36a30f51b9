"""Your own prompts: a JSONL file validated in full, then rendered like the generated tasks.

One JSON object per line (blank lines are skipped)::

    {"id": "q1", "prompt": "Who wrote Hamlet?", "answer": "Shakespeare", "grader": "contains"}
    {"id": "q2", "messages": [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "2+2?"}], "answer": "4"}

Fields (anything else is an error):

``id`` (str, required, unique)
    The sequence id in the store (a rerun skips ids the store already holds).
``prompt`` (str) or ``messages`` (list of ``{"role", "content"}`` with at least one ``user``)
    Exactly one of the two. The *context* is the text of ``prompt`` / of the last user message.
``question`` (str, optional)
    Appended to the context after a blank line and recorded as the question span (so
    question-aware and question-agnostic scores can both be replayed). Without it, the question
    span is empty and sits at the end of the context.
``answer`` (str, optional) and ``grader`` (``exact`` | ``contains`` | ``regex``, default
``contains`` when an answer is given)
    How ``correct`` is computed from the generated text; without an answer, ``correct`` is null.
``task`` (str, default ``"custom"``) and ``max_new_tokens`` (int in [1, 32768], optional).

Bounds (``docs/threat-model.md``), checked before the model loads: at most
:data:`MAX_PROMPT_LINES` prompts, :data:`MAX_LINE_BYTES` bytes per line, :data:`MAX_MESSAGES`
messages per prompt and :data:`MAX_PATTERN_BYTES` bytes per regex answer; ``tracesim capture``
then tokenizes every prompt (tokenizer and config only, no weights) and refuses one whose tokens
plus its new tokens exceed the model's context (:func:`check_context`). Regex graders run on
RE2 (``google-re2``): matching is linear in the text, so no pattern can backtrack
catastrophically; patterns RE2 does not support (backreferences, lookaround) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import re2
from tracesim.capture.tasks import TaskPrompt
from tracesim.capture.tasks import special_prefix as _special_prefix

from tracesim.counts import Count

__all__ = ["GRADERS", "MAX_LINE_BYTES", "MAX_MESSAGES", "MAX_NEW_TOKENS", "MAX_PATTERN_BYTES",
           "MAX_PROMPT_LINES", "PromptError", "PromptSpec", "check_context", "compile_pattern",
           "grade_answer", "load_prompts", "render_prompt"]

GRADERS = ("exact", "contains", "regex")
FIELDS = ("id", "prompt", "messages", "question", "answer", "grader", "task", "max_new_tokens")
ROLES = ("system", "user", "assistant")
_CTX, _Q = "\x00CONTEXT\x00", "\x00QUESTION\x00"
#: Largest prompts file accepted (bytes); 64 MiB holds thousands of 128k-token prompts.
MAX_PROMPTS_BYTES = 64 << 20
#: Largest line (bytes): about 500k tokens of English, beyond every context tracesim captures;
#: a 10 MB line would otherwise be tokenized (and allocated) in full before anything refused it.
MAX_LINE_BYTES = 2 << 20
#: Most prompt lines (non-blank) in one file.
MAX_PROMPT_LINES = 100_000
#: Most messages in one prompt (a chat template renders each).
MAX_MESSAGES = 1000
#: Largest regex answer (bytes); RE2 bounds its own memory, this bounds the compile time.
MAX_PATTERN_BYTES = 4096
#: ``max_new_tokens`` of a prompt line or of ``--max-new-tokens``.
MAX_NEW_TOKENS = Count("new tokens", 1 << 15)


def _re2_options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # a refused pattern is our one-line message, not an absl log
    return options


_RE2_OPTIONS = _re2_options()


class PromptError(ValueError):
    """A malformed prompts file; the message names the file, the line and the field."""


@dataclass(frozen=True)
class PromptSpec:
    """One validated line of a prompts file (``line`` is its 1-based line number)."""

    id: str
    line: int
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    question: str | None = None
    answer: str | None = None
    grader: str | None = None
    task: str = "custom"
    max_new_tokens: int | None = None


def _check_line(obj: Any, where: str) -> PromptSpec:
    def bad(name: str, expected: str) -> PromptError:
        return PromptError(f"{where}: field {name!r} is {obj.get(name)!r}, expected {expected}")

    if not isinstance(obj, dict):
        raise PromptError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = [k for k in obj if k not in FIELDS]
    if unknown:
        raise PromptError(f"{where}: unknown field {unknown[0]!r}, expected fields among "
                          f"{list(FIELDS)}")
    if not isinstance(obj.get("id"), str) or not obj["id"].strip():
        raise bad("id", "a non-empty string")
    from tracesim.store.format import StoreError, check_sequence_id

    try:
        check_sequence_id(obj["id"])
    except StoreError as exc:
        raise PromptError(f"{where}: {exc}") from None
    has_p, has_m = "prompt" in obj, "messages" in obj
    if has_p == has_m:
        raise PromptError(f"{where}: fields 'prompt' and 'messages': expected exactly one of "
                          "the two")
    if has_p and (not isinstance(obj["prompt"], str) or not obj["prompt"].strip()):
        raise bad("prompt", "a non-empty string")
    if has_m:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise bad("messages", "a non-empty list of {'role', 'content'} objects")
        if len(msgs) > MAX_MESSAGES:
            raise PromptError(f"{where}: field 'messages' lists {len(msgs)} messages, expected "
                              f"at most {MAX_MESSAGES}")
        for i, m in enumerate(msgs):
            if (not isinstance(m, dict) or set(m) != {"role", "content"}
                    or m["role"] not in ROLES or not isinstance(m["content"], str)):
                raise PromptError(f"{where}: field 'messages[{i}]' is {m!r}, expected "
                                  f"{{'role': one of {list(ROLES)}, 'content': str}}")
        if not any(m["role"] == "user" for m in msgs):
            raise bad("messages", "at least one message with role 'user'")
    for name in ("question", "answer", "task"):
        if name in obj and not isinstance(obj[name], str):
            raise bad(name, "a string")
    if "task" in obj and not obj["task"].strip():
        raise bad("task", "a non-empty string")
    grader = obj.get("grader")
    if grader is not None and grader not in GRADERS:
        raise bad("grader", f"one of {list(GRADERS)}")
    if grader is not None and "answer" not in obj:
        raise PromptError(f"{where}: field 'grader' is {grader!r} but there is no 'answer' to "
                          "grade against; expected an 'answer' field")
    if grader == "regex":
        compile_pattern(obj["answer"], where)
    mnt = obj.get("max_new_tokens")
    if mnt is not None:
        MAX_NEW_TOKENS.check(mnt, f"{where}: field 'max_new_tokens'", PromptError)
    return PromptSpec(id=obj["id"], line=0, prompt=obj.get("prompt"), messages=obj.get("messages"),
                      question=obj.get("question"), answer=obj.get("answer"),
                      grader=grader or ("contains" if "answer" in obj else None),
                      task=obj.get("task", "custom"), max_new_tokens=mnt)


def load_prompts(path: str | Path) -> list[PromptSpec]:
    """Read and validate a whole prompts file (nothing is captured before this succeeds).

    Raises
    ------
    PromptError
        ``FILE:LINE: field 'x' is ..., expected ...`` for the first malformed line, a
        duplicate id, or an empty file.
    """
    from tracesim.safeio import loads_json, read_text

    path = Path(path)
    try:
        text = read_text(path, MAX_PROMPTS_BYTES, "prompts file", error=PromptError)
    except OSError as exc:
        raise PromptError(f"{path}: cannot read the prompts file ({exc.strerror or exc}), "
                          "expected a JSONL file") from None
    out: list[PromptSpec] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{n}"
        if len(out) >= MAX_PROMPT_LINES:
            raise PromptError(f"{where}: more than {MAX_PROMPT_LINES} prompts, expected at most "
                              f"{MAX_PROMPT_LINES} per file")
        size = len(raw.encode("utf-8", "surrogatepass"))
        if size > MAX_LINE_BYTES:
            raise PromptError(f"{where}: line has {size} bytes, expected at most "
                              f"{MAX_LINE_BYTES}")
        # loads_json: duplicate keys refused, nesting depth scanned before parsing
        obj = loads_json(raw, where, error=PromptError)
        spec = _check_line(obj, where)
        if spec.id in seen:
            raise PromptError(f"{where}: field 'id' is {spec.id!r}, already used on line "
                              f"{seen[spec.id]}; expected unique ids")
        seen[spec.id] = n
        out.append(PromptSpec(**{**spec.__dict__, "line": n}))
    if not out:
        raise PromptError(f"{path}: no prompt found, expected one JSON object per line")
    return out


def compile_pattern(pattern: str, where: str) -> re2._Regexp:
    """A regex answer compiled by RE2 (linear-time matching; no catastrophic backtracking).

    Raises
    ------
    PromptError
        Naming ``where`` and the field if the pattern is too long or RE2 refuses it.
    """
    size = len(pattern.encode("utf-8", "surrogatepass"))
    if size > MAX_PATTERN_BYTES:
        raise PromptError(f"{where}: field 'answer' is a {size}-byte regular expression, "
                          f"expected at most {MAX_PATTERN_BYTES} bytes")
    try:
        return re2.compile(pattern, options=_RE2_OPTIONS)
    except (re2.error, ValueError, TypeError) as exc:
        arg = exc.args[0] if exc.args else exc
        text = arg.decode("utf-8", "replace") if isinstance(arg, bytes) else str(arg)
        reason = " ".join(text.split())[:120]
        raise PromptError(f"{where}: field 'answer' is not a regular expression RE2 accepts "
                          f"({reason}), expected one since grader is 'regex' (no "
                          "backreferences or lookaround)") from None


def check_context(rendered: TaskPrompt, spec: PromptSpec, where: str, context: int,
                  new_tokens: int) -> None:
    """Refuse a rendered prompt whose tokens plus the ``new_tokens`` it will generate exceed
    the model's ``context``.

    Raises
    ------
    PromptError
        ``FILE:LINE: field 'prompt' is N tokens + M new tokens = T, expected at most C``.
    """
    total = rendered.prompt_length + new_tokens
    if total > context:
        field = "messages" if spec.messages is not None else "prompt"
        raise PromptError(f"{where}: field {field!r} is {rendered.prompt_length} tokens + "
                          f"{new_tokens} new tokens = {total}, expected at most "
                          f"{context} (the model's context)")


def grade_answer(grader: str | None, generated: str, answer: str | None) -> bool | None:
    """``correct`` of a generated text: None without an answer.

    ``exact``: the text, stripped of surrounding whitespace and of one trailing ``.``, equals the
    answer (stripped); ``contains``: the answer occurs in the text; ``regex``: RE2's ``search``
    finds the answer pattern in the text (linear time). All are case-sensitive.
    """
    if answer is None or grader is None:
        return None
    if grader == "exact":
        text = generated.strip()
        return text.removesuffix(".").strip() == answer.strip() or text == answer.strip()
    if grader == "contains":
        return answer in generated
    if grader == "regex":
        return re2.compile(answer, options=_RE2_OPTIONS).search(generated) is not None
    raise ValueError(f"unknown grader {grader!r}; expected one of {GRADERS}")


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def render_prompt(tokenizer: Any, spec: PromptSpec, *, chat_template: bool = True,
                  max_new_tokens: int = 32) -> TaskPrompt:
    """Tokenize one prompt; context and question boundaries are exact token positions.

    The chat template (if the tokenizer has one and ``chat_template``) is rendered around
    placeholders and split, so the pieces before the context, the context, the question and the
    tail are tokenized separately. Without a template the prompt text is used as is, after the
    tokenizer's special prefix (BOS), if any; ``messages`` then need a template.

    Raises
    ------
    PromptError
        If ``messages`` are given without a chat template.
    """
    where = f"line {spec.line} (id {spec.id!r})"
    if spec.messages is not None:
        last = max(i for i, m in enumerate(spec.messages) if m["role"] == "user")
        context = spec.messages[last]["content"]
    else:
        context = spec.prompt or ""
    sep = "\n\n" if spec.question is not None else ""
    use_template = chat_template and bool(getattr(tokenizer, "chat_template", None))
    if spec.messages is not None and not use_template:
        raise PromptError(f"{where}: field 'messages' needs a chat template, but "
                          + ("--no-chat-template was given" if not chat_template else
                             "the tokenizer has none") + "; expected 'prompt'")
    if use_template:
        msgs = list(spec.messages or [{"role": "user", "content": ""}])
        if spec.messages is None:
            last = 0
        msgs[last] = {"role": "user", "content": f"{_CTX}{sep}{_Q}"}
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        head, rest = text.split(_CTX)
        middle, tail = rest.split(_Q)
        head_ids = _encode(tokenizer, head)
    else:
        middle, tail = sep, ""
        head_ids = _special_prefix(tokenizer)
    ctx_ids = _encode(tokenizer, context)
    mid_ids = _encode(tokenizer, middle)
    q_ids = _encode(tokenizer, spec.question or "")
    tail_ids = _encode(tokenizer, tail)
    token_ids = head_ids + ctx_ids + mid_ids + q_ids + tail_ids
    cs = len(head_ids)
    ce = cs + len(ctx_ids)
    qs = ce + len(mid_ids)
    qe = qs + len(q_ids)
    return TaskPrompt(task=spec.task, length=len(token_ids), seed=0, depth=0.0,
                      token_ids=token_ids, context_start=cs, context_end=ce, question_start=qs,
                      question_end=qe, prompt_length=len(token_ids), context=context,
                      question=spec.question or "", answer_prefix="",
                      gold=spec.answer if spec.answer is not None else "",
                      max_new_tokens=spec.max_new_tokens or max_new_tokens,
                      meta={"grader": spec.grader, "has_answer": spec.answer is not None})
