"""Capture from your own prompts: JSONL validation, rendering, and the whole path end to end
(capture -> validate -> replay -> report) on five hand-written prompts with SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tracesim.capture.cli import parse_indices
from tracesim.capture.prompts import PromptError, grade_answer, load_prompts, render_prompt

from tracesim.app.cli import main
from tracesim.dataset_read import read_results
from tracesim.store import open_store, validate_store

FIVE = [
    {"id": "capital-fr", "prompt": "What is the capital of France? Answer in one word.",
     "answer": "Paris", "grader": "contains", "task": "geo"},
    {"id": "sum", "prompt": "Compute 12 + 30. Reply with the number only.", "answer": "42",
     "grader": "regex", "task": "math", "max_new_tokens": 6},
    {"id": "colour", "messages": [{"role": "system", "content": "Answer briefly."},
                                  {"role": "user", "content": "The sky on a clear day is"}],
     "answer": "blue", "grader": "contains", "task": "geo"},
    {"id": "story", "prompt": "Alice keeps her key under the red mat. Bob keeps his under "
     "the green pot.", "question": "Where does Alice keep her key?", "answer": "mat",
     "task": "recall"},
    {"id": "open", "prompt": "Write the first word of a poem about rain.", "task": "free"},
]


def _write(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize("line,field", [
    ('{"prompt": "x"}', "'id'"),
    ('{"id": "a", "prompt": "x", "messages": []}', "'prompt' and 'messages'"),
    ('{"id": "a", "prompt": "x", "grader": "fuzzy", "answer": "y"}', "'grader'"),
    ('{"id": "a", "prompt": "x", "grader": "exact"}', "no 'answer'"),
    ('{"id": "a", "prompt": "x", "answer": "(", "grader": "regex"}', "regular expression"),
    ('{"id": "a", "messages": [{"role": "bot", "content": "x"}]}', "'messages[0]'"),
    ('{"id": "a", "prompt": "x", "colour": 1}', "unknown field 'colour'"),
    ('{"id": "a", "prompt": "x", "max_new_tokens": 0}', "'max_new_tokens'"),
    ('{"id": "a", "prompt": 7}', "'prompt'"),
    ('{"id": "a", "prompt": "x"', "not valid JSON"),
    ('{"id": "../x", "prompt": "x"}', "path traversal"),
])
def test_malformed_line_names_line_and_field(tmp_path, line, field):
    path = _write(tmp_path / "p.jsonl", [FIVE[0], "", line])
    with pytest.raises(PromptError) as info:
        load_prompts(path)
    assert f"{path}:3:" in str(info.value) and field in str(info.value)


def test_duplicate_ids_and_empty_file(tmp_path):
    with pytest.raises(PromptError, match=r":2: field 'id' is 'sum', already used on line 1"):
        load_prompts(_write(tmp_path / "d.jsonl", [FIVE[1], FIVE[1]]))
    with pytest.raises(PromptError, match="no prompt found"):
        load_prompts(_write(tmp_path / "e.jsonl", [""]))


def test_graders_and_index_lists():
    assert grade_answer("exact", " Paris.\n", "Paris") is True
    assert grade_answer("exact", "Paris is", "Paris") is False
    assert grade_answer("contains", "It is Paris.", "Paris") is True
    assert grade_answer("regex", "= 42", r"\b42\b") is True
    assert grade_answer("regex", "420", r"\b42\b") is False
    assert grade_answer(None, "anything", None) is None
    assert parse_indices("0,4,8-10", "--layers") == [0, 4, 8, 9, 10]
    with pytest.raises(ValueError, match="--heads"):
        parse_indices("a-b", "--heads")


def test_bad_file_exits_2_and_writes_nothing(tmp_path, capsys):
    path = _write(tmp_path / "p.jsonl", [FIVE[0], '{"id": "x", "grader": "exact"}'])
    out = tmp_path / "store"
    assert main(["capture", "--prompts", str(path), "--out", str(out), "--quiet"]) == 2
    captured = capsys.readouterr()
    msg = captured.err  # refusals go to stderr, nothing to stdout
    assert not captured.out
    assert f"{path}:2:" in msg and "Traceback" not in msg
    assert not out.exists()


@pytest.mark.capture
def test_rendering_boundaries_with_smollm2_tokenizer():
    from tracesim.capture.models import load_tokenizer

    tok = load_tokenizer("smollm2")
    spec = load_prompts_from(FIVE)[3]
    p = render_prompt(tok, spec)
    ids = p.token_ids
    assert tok.decode(ids[p.context_start:p.context_end]) == spec.prompt
    assert tok.decode(ids[p.question_start:p.question_end]) == spec.question
    # Pieces are tokenized separately; together they spell the rendered template exactly.
    assert tok.decode(ids) == tok.apply_chat_template(
        [{"role": "user", "content": f"{spec.prompt}\n\n{spec.question}"}],
        tokenize=False, add_generation_prompt=True)
    plain = render_prompt(tok, spec, chat_template=False)
    assert tok.decode(plain.token_ids) == f"{spec.prompt}\n\n{spec.question}"
    with pytest.raises(PromptError, match="'messages' needs a chat template"):
        render_prompt(tok, load_prompts_from(FIVE)[2], chat_template=False)


def load_prompts_from(rows: list, tmp: Path | None = None):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return load_prompts(_write(Path(d) / "p.jsonl", rows))


@pytest.mark.capture
def test_five_prompts_capture_validate_replay_report(tmp_path, capsys):
    prompts = _write(tmp_path / "mine.jsonl", FIVE)
    store = tmp_path / "store"
    argv = ["capture", "--prompts", str(prompts), "--out", str(store), "--max-new-tokens", "6",
            "--window", "8", "--layers", "0,2-3", "--heads", "1", "--dtype", "float32",
            "--quiet"]
    assert main(argv) == 0
    assert validate_store(store) == []
    assert main(["validate", str(store)]) == 0
    s = open_store(store)
    assert sorted(s.sequence_ids) == sorted(r["id"] for r in FIVE)
    m = s.model
    assert (m.n_layers, m.n_kv_heads, m.n_heads) == (3, 1, 3)
    kept = json.loads((store / "model.json").read_text())["kept"]
    assert kept["layers"] == [0, 2, 3] and kept["kv_heads"] == [1]
    assert kept["heads"] == [3, 4, 5] and kept["model_n_layers"] == 30
    assert s.o_proj(0).shape == (576, 3 * 64)
    rows = {r["sequence_id"]: r for r in s.manifest.to_pylist()}
    assert rows["open"]["correct"] is None and rows["open"]["gold"] is None
    assert rows["story"]["question_end"] > rows["story"]["question_start"]
    assert all(isinstance(rows[r]["correct"], bool) for r in rows if r != "open")
    assert {r["task"] for r in rows.values()} == {"geo", "math", "recall", "free"}
    # Resuming with another subset is refused (exit 2), the same one skips everything.
    assert main([*argv[:-5], "--layers", "1", "--quiet"]) == 2
    assert main(argv) == 0
    assert "skipped 5" in capsys.readouterr().out

    results = tmp_path / "results"
    assert main(["replay", str(store), "--score", "snapkv,keydiff", "--design", "topk,poisson",
                 "--budget", "0.5", "--seeds", "4", "--window", "4", "--no-progress",
                 "--out", str(results)]) == 0
    table = read_results(results).to_pandas()  # every part, verified
    assert set(table["layer"]) == {0, 1, 2} and set(table["head"]) == {0, 1, 2}
    assert set(table["sequence_id"]) == set(rows)
    # An ungraded prompt stays null in the results, never a made-up False.
    assert table.loc[table["sequence_id"] == "open", "correct"].isna().all()
    assert table.loc[table["sequence_id"] != "open", "correct"].notna().all()
    assert main(["report", str(results), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "report.html").is_file()
