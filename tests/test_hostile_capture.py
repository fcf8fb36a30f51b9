"""Hostile prompts files for ``tracesim capture`` (issue #32, family 1).

Every case must exit 2 with one line on stderr naming the file, the line and the field (or the
option) and the limit, create no store directory, and never load model weights: the checkpoint
built here has a tokenizer and a config but no weights at all, so a case that got as far as
loading the model would fail differently. The tokenizer is a tiny word-level one built in the
test (no download, no shipped model).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.capture

CONTEXT = 64  # the tiny checkpoint's max_position_embeddings


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint directory with tokenizer and config files only (no weights)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tiny-ckpt")
    vocab = {"[UNK]": 0, "[BOS]": 1, "[EOS]": 2}
    for word in ("the", "key", "is", "under", "mat", "what", "where", "x", "a"):
        vocab[word] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]",
                                   eos_token="[EOS]")
    fast.save_pretrained(root)
    LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                max_position_embeddings=CONTEXT).save_pretrained(root)
    assert not list(root.glob("*.safetensors")) and not list(root.glob("*.bin"))
    return root


def _jsonl(path: Path, rows: list) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def _cases(root: Path) -> list[tuple[str, list[str], list[str]]]:
    """(name, extra argv, substrings of the message)."""
    ok = {"id": "ok", "prompt": "the key is under the mat", "answer": "mat"}
    long_words = " ".join(["the"] * 200)  # 200 tokens > the 64-token context
    cases = []
    p = _jsonl(root / "long.jsonl", [ok, {"id": "long", "prompt": long_words}])
    cases.append(("prompt longer than the context", ["--prompts", p],
                  ["long.jsonl:2", "'prompt'", "200 tokens", f"at most {CONTEXT}"]))
    p = _jsonl(root / "long-q.jsonl", [{"id": "q", "prompt": "x", "question": long_words}])
    cases.append(("question pushes past the context", ["--prompts", p],
                  ["long-q.jsonl:1", "'prompt'", f"at most {CONTEXT}"]))
    p = _jsonl(root / "mnt.jsonl", [{"id": "m", "prompt": "the key", "max_new_tokens": 63}])
    cases.append(("new tokens push past the context", ["--prompts", p],
                  ["mnt.jsonl:1", "63 new tokens", f"at most {CONTEXT}"]))
    p = _jsonl(root / "ok.jsonl", [ok])
    cases.append(("--max-new-tokens past the context", ["--prompts", p, "--max-new-tokens",
                                                        "63"], ["ok.jsonl:1", "63 new tokens"]))
    cases.append(("--max-new-tokens beyond its bound", ["--prompts", p, "--max-new-tokens",
                                                        "10000000"], ["--max-new-tokens",
                                                                      "32768"]))
    p = _jsonl(root / "mnt-big.jsonl", [{"id": "m", "prompt": "x", "max_new_tokens": 10**12}])
    cases.append(("max_new_tokens beyond its bound", ["--prompts", p],
                  ["mnt-big.jsonl:1", "'max_new_tokens'", "32768"]))
    p = _jsonl(root / "wide.jsonl", [{"id": "w", "prompt": "a " * (3 << 20)}])
    cases.append(("a 6 MiB line", ["--prompts", p], ["wide.jsonl:1", "bytes", str(2 << 20)]))
    msgs = [{"role": "user", "content": ""}] * 60_000  # 1.7 MB: within the line limit
    p = _jsonl(root / "msgs.jsonl", [json.dumps({"id": "m", "messages": msgs},
                                                separators=(",", ":"))])
    cases.append(("60,000 empty messages", ["--prompts", p],
                  ["msgs.jsonl:1", "'messages'", "60000", "1000"]))
    p = _jsonl(root / "lines.jsonl", [{"id": f"p{i}", "prompt": "x"} for i in range(100_001)])
    cases.append(("100,001 prompt lines", ["--prompts", p], ["lines.jsonl:100001", "100000"]))
    for name, pattern in (("backreference", r"(a)\1"), ("lookahead", r"a(?=b)"),
                          ("long pattern", "a" * 5000)):
        p = _jsonl(root / f"re-{name[:4]}.jsonl", [{"id": "r", "prompt": "x", "answer": pattern,
                                                    "grader": "regex"}])
        cases.append((f"regex grader: {name}", ["--prompts", p], [f"re-{name[:4]}.jsonl:1",
                                                                  "'answer'"]))
    cases.append(("--length past the context", ["--length", "100"], ["--length", "context"]))
    cases.append(("--n beyond its bound", ["--n", "100000000"], ["--n", "10000"]))
    return cases


def test_hostile_prompts_exit_2_before_weights(tiny_checkpoint, tmp_path, capsys):
    from tracesim.app.cli import main

    cases = _cases(tmp_path)
    assert len(cases) >= 12
    for name, argv, expect in cases:
        out = tmp_path / "store"
        t0 = time.process_time()
        code = main(["capture", "--model", str(tiny_checkpoint), "--out", str(out), "--quiet",
                     "--device", "cpu", *argv])
        seconds = time.process_time() - t0
        captured = capsys.readouterr()
        msg = captured.err.strip()
        assert code == 2, (name, msg)
        assert not captured.out, name  # refusals on stderr only
        assert "\n" not in msg and "Traceback" not in msg, (name, msg)
        assert all(e in msg for e in expect), (name, expect, msg)
        assert not out.exists(), name  # no store directory, no partial output
        assert seconds < 10, (name, seconds)  # CPU time: the same on a loaded machine


def test_prompt_within_the_context_passes_the_checks(tiny_checkpoint, tmp_path):
    """The same checks accept a prompt that fits (the run then reaches the model loader,
    which finds no weights: the checks ran without them)."""
    import argparse

    from tracesim.capture.cli import _check_fit, _tokenizer_and_context
    from tracesim.capture.prompts import load_prompts

    tok, context = _tokenizer_and_context(str(tiny_checkpoint))
    assert context == CONTEXT and tok.encode("the key", add_special_tokens=False) == [3, 4]
    path = _jsonl(tmp_path / "fit.jsonl", [{"id": "a", "prompt": " ".join(["the"] * 20),
                                            "max_new_tokens": 40}])
    args = argparse.Namespace(model=str(tiny_checkpoint), prompts=path, max_new_tokens=None,
                              no_chat_template=True, prompt_specs=load_prompts(path), length=8)
    _check_fit(args)  # 20 + 40 = 60 <= 64 (this tokenizer adds no BOS)
    args.prompt_specs = load_prompts(_jsonl(tmp_path / "over.jsonl", [
        {"id": "a", "prompt": " ".join(["the"] * 20), "max_new_tokens": 45}]))
    with pytest.raises(ValueError, match="65, expected at most 64"):
        _check_fit(args)


def test_regex_grader_is_linear_time():
    """A nested-quantifier pattern that backtracks for minutes in ``re`` grades at once."""
    from tracesim.capture.prompts import compile_pattern, grade_answer

    text = "x" * 50_000
    t0 = time.process_time()
    assert grade_answer("regex", text, r"(x+x+)+y") is False
    assert grade_answer("regex", "answer: 42.", r"\b42\b") is True
    assert time.process_time() - t0 < 5
    assert compile_pattern(r"(a|b)*c", "p:1").search("ababc")


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_every_builtin_model_reaches_the_prompt_checks(tiny_checkpoint, tmp_path, monkeypatch,
                                                       name):
    """A built-in model name is checked from its converted checkpoint in the cache (the tiny
    checkpoint stands in for it), never refused as 'not a checkpoint directory'."""
    import shutil

    from tracesim.capture import models
    from tracesim.capture.cli import _tokenizer_and_context

    monkeypatch.setenv("TRACESIM_CACHE", str(tmp_path))
    target = tmp_path / f"{models.BUILTIN_MODELS[name]}-v1"
    shutil.copytree(tiny_checkpoint, target)
    assert models.converted_checkpoint(name) == target
    _, context = _tokenizer_and_context(name)
    assert context == CONTEXT
