"""Generated tasks: determinism, lengths, boundaries, graders."""

from __future__ import annotations

import pytest
from tracesim.capture.cli import _TASKS as CLI_TASKS
from tracesim.capture.models import load_tokenizer
from tracesim.capture.runner import query_roles
from tracesim.capture.tasks import TASKS, build_prompt, grade, instance_seed

pytestmark = pytest.mark.capture


class CharTokenizer:
    """One token per character, no chat template: exercises the plain-prompt fallback."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


@pytest.fixture(scope="module")
def smol_tok():
    return load_tokenizer("smollm2")


@pytest.fixture(params=["smollm2", "chars"])
def tok(request, smol_tok):
    return smol_tok if request.param == "smollm2" else CharTokenizer()


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [256, 700])
def test_boundaries_match_token_ids(tok, task, length):
    if isinstance(tok, CharTokenizer):
        length *= 4  # characters, not BPE tokens
    p = build_prompt(tok, task, length, seed=instance_seed(task, length, 0, 1))
    ids = p.token_ids
    assert len(ids) == p.prompt_length
    assert 0 < p.context_start < p.context_end <= p.question_start
    assert p.question_start < p.question_end < p.prompt_length
    assert tok.decode(ids[p.context_start : p.context_end]) == p.context
    assert tok.decode(ids[p.question_start : p.question_end]) == p.question
    assert tok.decode(ids[p.question_end :]).endswith(p.answer_prefix)
    # Filled up to the target: at most one filler piece (< 40 tokens here) short of it.
    piece = 120 if isinstance(tok, CharTokenizer) else 40
    assert length - piece < p.prompt_length <= length
    assert p.gold in p.context


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_per_seed_and_depth(smol_tok, task):
    a = build_prompt(smol_tok, task, 400, seed=42)
    b = build_prompt(smol_tok, task, 400, seed=42)
    c = build_prompt(smol_tok, task, 400, seed=43)
    assert a == b
    assert a.token_ids != c.token_ids and a.gold != c.gold
    shallow = build_prompt(smol_tok, task, 600, seed=7, depth=0.1)
    deep = build_prompt(smol_tok, task, 600, seed=7, depth=0.9)
    assert shallow.gold == deep.gold
    def needle_at(p):
        return p.context.index(p.gold) / len(p.context)

    assert needle_at(shallow) < 0.3 and needle_at(deep) > 0.7


def test_instance_seeds_are_distinct_and_stable():
    seeds = {instance_seed(t, L, s, i) for t in TASKS for L in (512, 1024) for s in (0, 1)
             for i in range(20)}
    assert len(seeds) == len(TASKS) * 2 * 2 * 20
    assert all(0 <= s < 2**63 for s in seeds)
    assert instance_seed("passkey", 1024, 0, 0) == instance_seed("passkey", 1024, 0, 0)


@pytest.mark.parametrize("task", TASKS)
def test_graders_accept_right_and_reject_wrong(task):
    gold = "482913"
    for right in (f" {gold}.", f"{gold}", f" {gold}, remember it", f"\n{gold} is the answer"):
        assert grade(task, right, gold)
    wrong_gold = str(int(gold) + 1)
    for wrong in ("", " I do not know.", f" {gold[:-1]}.", f" {gold}7", f" {wrong_gold}",
                  f" 1. {gold}", f" {wrong_gold} or {gold}"):
        assert not grade(task, wrong, gold)


def test_grader_on_real_prompts(smol_tok):
    for task in TASKS:
        p = build_prompt(smol_tok, task, 300, seed=5)
        assert grade(task, f" {p.gold}.", p.gold)
        assert not grade(task, " 0.", p.gold)


def test_multikey_and_vartrack_distractors(smol_tok):
    mk = build_prompt(smol_tok, "multikey", 500, seed=3, n_keys=4)
    assert mk.context.count("One of the special magic numbers for") == 4
    vt = build_prompt(smol_tok, "vartrack", 500, seed=3, n_hops=2, n_distractors=2)
    assert vt.context.count("VAR ") == 3 * 3 + 3 * 2  # 3 chains x (1 assignment + 2 hops)
    target = vt.question.split("VAR ")[1].rstrip("?")
    assert f"VAR {target} = VAR " in vt.context


def test_errors():
    with pytest.raises(ValueError, match="unknown task"):
        build_prompt(CharTokenizer(), "nope", 100, 0)
    with pytest.raises(ValueError, match="too short"):
        build_prompt(CharTokenizer(), "passkey", 50, 0)
    with pytest.raises(ValueError, match="depth"):
        build_prompt(CharTokenizer(), "passkey", 500, 0, depth=1.5)
    with pytest.raises(ValueError, match="unknown task"):
        grade("nope", "1", "1")


def test_query_roles_precedence():
    # prompt 100, question at 90, 5 decode positions, w = 16: windows overlap on 84..89.
    pos, roles = query_roles(100, 90, 105, 16, False)
    assert pos == list(range(74, 105))
    assert roles[:16] == ["context_window"] * 16  # 74..89 (84..89 are in both windows)
    assert roles[16:26] == ["question_window"] * 10  # 90..99
    assert roles[26:] == ["decode"] * 5
    pos, roles = query_roles(100, 90, 105, 16, True)
    assert pos == list(range(105)) and roles[:74] == ["all"] * 74
    pos, _ = query_roles(10, 5, 10, 32, False)  # windows clipped at 0
    assert pos == list(range(10))


def test_cli_task_list_mirrors_tasks():
    assert tuple(CLI_TASKS) == TASKS
