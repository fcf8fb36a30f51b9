"""Capture runs into a trace store: round trip, interruption and resumption, the CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from tracesim.capture.models import (
    LoadedModel,
    load_model,
    load_tokenizer,
    o_proj_weights,
    tiny_model,
)
from tracesim.capture.runner import (
    CaptureConfig,
    capture_prompt,
    query_roles,
    run_capture,
    sequence_id,
)
from tracesim.capture.tasks import build_prompt, instance_seed

from tracesim.app.cli import main as tracesim_main
from tracesim.store import open_store, validate_store

pytestmark = pytest.mark.capture

LENGTH = 160
CFG = CaptureConfig(window=8, max_new_tokens=4)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def tiny(tokenizer):
    model = tiny_model("qwen2", seed=1, vocab_size=len(tokenizer))
    return LoadedModel(model, tokenizer, "tiny-qwen2")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tiny):
    """The tiny model saved as a local checkpoint directory (safetensors + tokenizer)."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny-qwen2"
    tiny.model.save_pretrained(path, safe_serialization=True)
    tiny.tokenizer.save_pretrained(path)
    return path


def _assert_same_store(a: Path, b: Path) -> None:
    sa, sb = open_store(a), open_store(b)
    assert sa.model == sb.model
    rows_a = sorted(sa.manifest.to_pylist(), key=lambda r: r["sequence_id"])
    rows_b = sorted(sb.manifest.to_pylist(), key=lambda r: r["sequence_id"])
    assert rows_a == rows_b  # checksums included: the tensor files are byte-identical
    m = sa.model
    for sid in sa.sequence_ids:
        x, y = sa[sid], sb[sid]
        for layer in range(m.n_layers):
            for h in range(m.n_kv_heads):
                np.testing.assert_array_equal(x.keys(layer, h), y.keys(layer, h))
                np.testing.assert_array_equal(x.values(layer, h), y.values(layer, h))
            for h in range(m.n_heads):
                np.testing.assert_array_equal(x.outputs(layer, h), y.outputs(layer, h))
                np.testing.assert_array_equal(x.h2o_scores(layer, h), y.h2o_scores(layer, h))


def _n_rows(store: Path) -> int:
    """Rows in a store's manifest (0 if there is none yet); the manifest is replaced atomically."""
    path = store / "manifest.parquet"
    return pq.read_metadata(path).num_rows if path.is_file() else 0


def test_capture_round_trip(tmp_path, tiny):
    out = tmp_path / "store"
    summary = run_capture(tiny, ["passkey", "kvret"], n=2, length=LENGTH, out=out,
                          storage_dtype="float32", config=CFG, progress=False, seed=3)
    assert validate_store(out) == []
    store = open_store(out)
    expected = [sequence_id(t, LENGTH, 3, i) for t in ("passkey", "kvret") for i in range(2)]
    assert summary.written == expected and store.sequence_ids == expected
    m = store.model
    assert (m.model_id, m.architecture, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim) == (
        "tiny-qwen2", "Qwen2ForCausalLM", 2, 4, 2, 16)
    # the RoPE settings of the config are recorded (ExpectedAttentionPress rotates back)
    cfg = tiny.model.config
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    assert m.rope_theta == float(theta) and m.rope_scaling["rope_type"] == "default"
    weights = o_proj_weights(tiny.model)
    for layer in range(m.n_layers):
        np.testing.assert_array_equal(store.o_proj(layer), weights[layer])

    seq = store[expected[2]]
    meta = seq.meta
    prompt = build_prompt(tiny.tokenizer, "kvret", LENGTH, instance_seed("kvret", LENGTH, 3, 0))
    assert meta["seed"] == prompt.seed and meta["gold"] == prompt.gold
    assert list(seq.token_ids[: prompt.prompt_length]) == prompt.token_ids
    assert seq.n_positions == prompt.prompt_length + len(meta["generated_ids"]) - 1
    qs, plen = meta["question_start"], meta["prompt_length"]
    positions, roles = query_roles(plen, qs, seq.n_positions, 8, False)
    assert seq.query_positions.tolist() == positions and seq.query_roles == roles
    assert roles.count("context_window") == 8 and roles.count("question_window") == 8
    assert roles.count("decode") == seq.n_positions - plen
    assert tiny.tokenizer.decode(seq.token_ids[meta["context_start"]: meta["context_end"]]) \
        == prompt.context

    # What is stored is what the recorder saw (fp32 storage: bit for bit).
    row, layers = capture_prompt(tiny, prompt, CFG)
    assert row["generated_ids"] == meta["generated_ids"]
    for layer, arrays in enumerate(layers):
        for h in range(m.n_kv_heads):
            np.testing.assert_array_equal(seq.keys(layer, h), arrays.keys[h])
            np.testing.assert_array_equal(seq.values(layer, h), arrays.values[h])
        for h in range(m.n_heads):
            np.testing.assert_array_equal(seq.queries(layer, h), arrays.queries[h])
            np.testing.assert_array_equal(seq.outputs(layer, h), arrays.outputs[h])
            np.testing.assert_array_equal(seq.h2o_scores(layer, h), arrays.h2o[h])


def test_exception_mid_run_leaves_valid_store_and_resume_matches(tmp_path, tiny):
    kw = dict(n=3, length=LENGTH, storage_dtype="float16", config=CFG, progress=False)
    run_capture(tiny, ["multikey"], out=tmp_path / "full", **kw)

    class Boom(Exception):
        pass

    def explode(sid, row):
        raise Boom(sid)

    with pytest.raises(Boom):
        run_capture(tiny, ["multikey"], out=tmp_path / "cut", on_sequence=explode, **kw)
    assert validate_store(tmp_path / "cut") == []
    assert len(open_store(tmp_path / "cut")) == 1
    resumed = run_capture(tiny, ["multikey"], out=tmp_path / "cut", **kw)
    assert len(resumed.skipped) == 1 and len(resumed.written) == 2
    _assert_same_store(tmp_path / "full", tmp_path / "cut")


def test_cli_killed_mid_run_resumes_to_same_store(tmp_path, tiny_dir):
    n = 12
    argv = ["capture", "--model", str(tiny_dir), "--tasks", "passkey", "--n", str(n),
            "--length", str(LENGTH), "--dtype", "float32", "--window", "8",
            "--max-new-tokens", "4", "--quiet"]
    cut = tmp_path / "cut"
    # the child runs on as many torch threads as this process (the stores are compared byte for
    # byte), whatever an earlier test left in the environment
    import torch

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               OMP_NUM_THREADS=str(torch.get_num_threads()))
    proc = subprocess.Popen([sys.executable, "-m", "tracesim.app.cli", *argv, "--out", str(cut)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while _n_rows(cut) < 1:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no sequence written in time"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert validate_store(cut) == []
    assert 1 <= len(open_store(cut)) < n
    assert tracesim_main([*argv, "--out", str(cut)]) == 0
    assert validate_store(cut) == []
    assert len(open_store(cut)) == n
    full = tmp_path / "full"
    run_capture(load_model(str(tiny_dir)), ["passkey"], n=n, length=LENGTH, out=full,
                storage_dtype="float32", config=CFG, progress=False)
    _assert_same_store(full, cut)


def test_cli_import_is_torch_free_and_help_works():
    code = ("import sys, argparse, tracesim.capture.cli as c; p = argparse.ArgumentParser(); "
            "c.register(p.add_subparsers()); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run([sys.executable, "-m", "tracesim.app.cli", "capture", "--help"],
                         check=True, capture_output=True, text=True).stdout
    for flag in ("--model", "--tasks", "--n", "--length", "--out", "--dtype", "--max-new-tokens",
                 "--window", "--all-positions", "--seed"):
        assert flag in out


def test_cli_rejects_unknown_task(tmp_path, capsys):
    assert tracesim_main(["capture", "--tasks", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "unknown task" in capsys.readouterr().err  # refusals go to stderr
