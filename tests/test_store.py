"""Tests of the trace store (tracesim.store): round trips, atomicity, resume, validation, CLI."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tracesim.app.cli import main as cli_main
from tracesim.store import (
    SCHEMA_VERSION,
    ModelMeta,
    StoreError,
    TraceWriter,
    open_store,
    validate_store,
)
from tracesim.store.manifest import MANIFEST_SCHEMA
from tracesim.store.tensorfile import TensorFile, write_tensor_file

REPO = Path(__file__).resolve().parents[1]


def make_model(dtype: str = "float32", **overrides) -> ModelMeta:
    fields = dict(model_id="toy", architecture="LlamaForCausalLM", n_layers=2, n_heads=4,
                  n_kv_heads=2, head_dim=8, hidden_size=16, scaling=8**-0.5, dtype=dtype)
    fields.update(overrides)
    return ModelMeta(**fields)


def make_sequence(model: ModelMeta, seed: int, n_positions: int = 40, prompt_length: int = 30):
    """A synthetic, valid sequence: (row, layers) with windows of 6 and decode queries."""
    rng = np.random.default_rng(seed)
    m = model
    qs, pl = prompt_length - 8, prompt_length
    ctx = list(range(qs - 6, qs))
    qwin = list(range(pl - 6, pl))
    dec = list(range(pl, n_positions))
    positions = ctx + qwin + dec
    roles = ["context_window"] * 6 + ["question_window"] * 6 + ["decode"] * len(dec)
    n_gen = n_positions - pl + 1
    row = dict(
        task="passkey", seed=seed, length=n_positions,
        token_ids=rng.integers(0, 1000, n_positions, dtype=np.int32),
        prompt_length=pl, context_start=2, context_end=qs - 2, question_start=qs,
        question_end=pl - 1, generated_ids=rng.integers(0, 1000, n_gen).tolist(),
        generated_logprobs=(-rng.random(n_gen)).astype(np.float32), answer="1234",
        gold="1234", correct=True, query_positions=positions, query_roles=roles,
    )
    layers = []
    n_q = len(positions)
    for _ in range(m.n_layers):
        h2o = np.zeros((m.n_heads, n_positions), np.float32)
        w = rng.random((m.n_heads, pl)) + 0.01
        h2o[:, :pl] = w / w.sum(axis=1, keepdims=True) * pl
        layers.append(dict(
            keys=rng.standard_normal((m.n_kv_heads, n_positions, m.head_dim), np.float32),
            values=rng.standard_normal((m.n_kv_heads, n_positions, m.head_dim), np.float32),
            queries=rng.standard_normal((m.n_heads, n_q, m.head_dim), np.float32),
            outputs=rng.standard_normal((m.n_heads, n_q, m.head_dim), np.float32),
            h2o=h2o,
        ))
    return row, layers


def write_sequence(writer: TraceWriter, sequence_id: str, row: dict, layers: list) -> None:
    with writer.sequence(sequence_id, **row) as sw:
        for layer, tensors in enumerate(layers):
            sw.add_layer(layer, **tensors)


@pytest.fixture
def model() -> ModelMeta:
    return make_model()


@pytest.fixture
def store_path(tmp_path: Path, model: ModelMeta) -> Path:
    """A valid store with two sequences, s0 and s1."""
    path = tmp_path / "store"
    with TraceWriter(path, model) as writer:
        for i in range(2):
            write_sequence(writer, f"s{i}", *make_sequence(model, i))
    return path


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes()
            for p in sorted(path.rglob("*")) if p.is_file() and p.name != ".lock"}


def rewrite_manifest(path: Path, change) -> None:
    rows = pq.read_table(path / "manifest.parquet").to_pylist()
    change(rows)
    pq.write_table(pq.read_table(path / "manifest.parquet").from_pylist(rows, MANIFEST_SCHEMA),
                   path / "manifest.parquet")


# --------------------------------------------------------------------------- model metadata


def test_model_meta_validation():
    assert make_model().group_size == 2 and make_model().kv_head(3) == 1
    with pytest.raises(StoreError, match="'n_heads'.*multiple of n_kv_heads"):
        make_model(n_heads=3)
    with pytest.raises(StoreError, match="'dtype'"):
        make_model(dtype="bfloat16")
    with pytest.raises(StoreError, match="'head_dim'.*positive int"):
        make_model(head_dim=0)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_round_trip_exact(tmp_path: Path, dtype: str):
    model = make_model(dtype)
    data = {f"s{i}": make_sequence(model, i, n_positions=40 + i) for i in range(2)}
    with TraceWriter(tmp_path, model) as writer:
        for sid, (row, layers) in data.items():
            write_sequence(writer, sid, row, layers)
    store = open_store(tmp_path)
    assert store.model == model and len(store) == 2 and store.sequence_ids == ["s0", "s1"]
    assert validate_store(tmp_path) == []
    for seq in store:
        row, layers = data[seq.sequence_id]
        assert seq.n_positions == len(row["token_ids"])
        np.testing.assert_array_equal(seq.token_ids, row["token_ids"])
        np.testing.assert_array_equal(seq.query_positions, row["query_positions"])
        assert seq.query_roles == row["query_roles"]
        assert seq.meta["generated_logprobs"] == row["generated_logprobs"].tolist()
        assert seq.meta["answer"] == "1234" and seq.meta["correct"] is True
        assert seq.meta["dtype"] == dtype and seq.meta["schema_version"] == SCHEMA_VERSION
        for layer, t in enumerate(layers):
            for h in range(model.n_kv_heads):
                for got, want in ((seq.keys(layer, h), t["keys"][h]),
                                  (seq.values(layer, h), t["values"][h])):
                    assert got.dtype == np.dtype(dtype)
                    np.testing.assert_array_equal(got, want.astype(dtype))
            for h in range(model.n_heads):
                np.testing.assert_array_equal(seq.queries(layer, h), t["queries"][h].astype(dtype))
                np.testing.assert_array_equal(seq.outputs(layer, h), t["outputs"][h].astype(dtype))
                h2o = seq.h2o_scores(layer, h)
                assert h2o.dtype == np.float32
                np.testing.assert_array_equal(h2o, t["h2o"][h])


def test_reads_are_zero_copy_views(store_path: Path):
    seq = open_store(store_path)["s1"]
    a, b = seq.keys(1, 1), seq.keys(1, 1)
    assert np.shares_memory(a, b)  # two reads view the same mapped bytes
    assert not a.flags.owndata and not a.flags.writeable
    assert not seq.h2o_scores(0, 3).flags.owndata
    with pytest.raises(IndexError):
        seq.keys(0, 2)  # only 2 kv heads
    with pytest.raises(KeyError):
        open_store(store_path)["nope"]


def test_o_proj_round_trip(tmp_path: Path, model: ModelMeta):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((model.n_layers, model.hidden_size, model.n_heads * model.head_dim))
    with TraceWriter(tmp_path / "a", model, o_proj=w) as writer:
        write_sequence(writer, "s0", *make_sequence(model, 0))
    store = open_store(tmp_path / "a")
    for layer in range(model.n_layers):
        got = store.o_proj(layer)
        assert got.dtype == np.float32 and not got.flags.owndata
        np.testing.assert_array_equal(got, w[layer].astype(np.float32))
    assert validate_store(tmp_path / "a") == []
    with pytest.raises(StoreError, match="o_proj.arrow: field 'o_proj' of layer 0 differs"):
        TraceWriter(tmp_path / "a", model, o_proj=w + 1)
    with pytest.raises(StoreError, match=r"'o_proj' has shape \(2, 16, 16\), expected"):
        TraceWriter(tmp_path / "b", model, o_proj=w[:, :, :16])
    # A store without o_proj answers None; adding it on resume stores it.
    TraceWriter(tmp_path / "c", model).close()
    assert open_store(tmp_path / "c").o_proj(0) is None
    TraceWriter(tmp_path / "c", model, o_proj=w).close()
    np.testing.assert_array_equal(open_store(tmp_path / "c").o_proj(1), w[1].astype(np.float32))


# --------------------------------------------------------------------------- writer rules


def test_resume_skips_finished(store_path: Path, model: ModelMeta):
    before = open_store(store_path)["s0"].keys(1, 0).copy()
    with TraceWriter(store_path, model) as writer:
        assert writer.has("s0") and writer.has("s1") and not writer.has("s2")
        with pytest.raises(StoreError, match="already stored"):
            writer.sequence("s0")
        for sid in ("s0", "s1", "s2"):
            if not writer.has(sid):
                row, layers = make_sequence(model, 2)
                row.update(n_positions=40, n_query=len(row["query_positions"]))  # optional
                write_sequence(writer, sid, row, layers)
    store = open_store(store_path)
    assert store.sequence_ids == ["s0", "s1", "s2"]
    np.testing.assert_array_equal(store["s0"].keys(1, 0), before)
    with pytest.raises(StoreError, match=r"model.json: .*field 'n_layers' is 2, expected 3"):
        TraceWriter(store_path, make_model(n_layers=3))


def test_exception_inside_sequence_leaves_store_unchanged(store_path: Path, model: ModelMeta):
    before = snapshot(store_path)
    row, layers = make_sequence(model, 5)
    with TraceWriter(store_path, model) as writer:
        with pytest.raises(RuntimeError, match="boom"):
            with writer.sequence("s5", **row) as sw:
                sw.add_layer(0, **layers[0])
                assert any(p.suffix == ".tmp" for p in (store_path / "seq").iterdir())
                raise RuntimeError("boom")
        assert not writer.has("s5")
        assert snapshot(store_path) == before
        # Incomplete sequence: raises at exit, nothing is added either.
        with pytest.raises(StoreError, match="1 layer\\(s\\) were added, expected n_layers = 2"):
            with writer.sequence("s5", **row) as sw:
                sw.add_layer(0, **layers[0])
        assert snapshot(store_path) == before
        write_sequence(writer, "s5", row, layers)  # the id is still free
    assert validate_store(store_path) == []


def test_bad_records_raise_naming_file_and_field(store_path: Path, model: ModelMeta):
    before = snapshot(store_path)
    row, layers = make_sequence(model, 7)
    with TraceWriter(store_path, model) as writer:
        bad = dict(layers[1], keys=layers[1]["keys"][:, :-1])
        with pytest.raises(StoreError) as info:
            with writer.sequence("abc", **row) as sw:
                sw.add_layer(0, **layers[0])
                sw.add_layer(1, **bad)
        assert str(info.value) == (
            "seq/abc.arrow [sequence 'abc']: field 'keys' of layer 1 has shape (2, 39, 8), "
            "expected (2, 40, 8)"
        )
        with pytest.raises(StoreError, match="field 'context_end' = 23, expected <= "
                                             "question_start = 22"):
            writer.sequence("abc", **dict(row, context_end=23))
        with pytest.raises(StoreError, match="field 'n_query' = 3, expected len"):
            writer.sequence("abc", **dict(row, n_query=3))
        with pytest.raises(StoreError, match="field 'generated_logprobs' holds NaN/Inf or a pos"):
            writer.sequence("abc", **dict(row, generated_logprobs=-row["generated_logprobs"]))
        with pytest.raises(StoreError, match="unknown field 'colour'"):
            writer.sequence("abc", colour="red")
        with pytest.raises(StoreError, match="field 'file' is set by the store"):
            writer.sequence("abc", file="x")
        with pytest.raises(StoreError, match="got layer 1, expected layer 0"):
            with writer.sequence("abc", **row) as sw:
                sw.add_layer(1, **layers[1])
        with pytest.raises(StoreError, match="'keys' of layer 0 holds NaN/Inf"):
            with writer.sequence("abc", **row) as sw:
                keys = layers[0]["keys"].copy()
                keys[0, 0, 0] = np.nan
                sw.add_layer(0, **dict(layers[0], keys=keys))
        with pytest.raises(StoreError, match=r"manifest field\(s\) \['gold'\] were never given"):
            partial = {k: v for k, v in row.items() if k != "gold"}
            write_sequence(writer, "abc", partial, layers)
    assert snapshot(store_path) == before


def test_float16_overflow_is_refused(tmp_path: Path):
    model = make_model("float16")
    row, layers = make_sequence(model, 0)
    layers[0]["values"][1, 3, 2] = 1e6
    with TraceWriter(tmp_path, model) as writer:
        with pytest.raises(StoreError, match="'values' of layer 0 overflows float16"):
            write_sequence(writer, "s0", row, layers)


def test_second_writer_is_refused(store_path: Path, model: ModelMeta):
    writer = TraceWriter(store_path, model)
    with pytest.raises(StoreError, match="another TraceWriter holds the lock"):
        TraceWriter(store_path, model)
    writer.close()
    TraceWriter(store_path, model).close()


def test_leftover_temp_files_removed_on_open(store_path: Path, model: ModelMeta):
    (store_path / "seq" / "s9.arrow.tmp").write_bytes(b"half a file")
    (store_path / "manifest.parquet.tmp").write_bytes(b"junk")
    assert validate_store(store_path) == []  # temp files are not part of the store
    TraceWriter(store_path, model).close()
    assert not list(store_path.rglob("*.tmp"))


def test_killed_writer_resumes(tmp_path: Path, model: ModelMeta):
    """A writer killed mid-sequence leaves a valid store; the next open cleans up."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO / "tests")!r})
        from test_store import make_model, make_sequence, write_sequence
        from tracesim.store import TraceWriter
        model = make_model()
        writer = TraceWriter({str(tmp_path)!r}, model)
        write_sequence(writer, "s0", *make_sequence(model, 0))
        row, layers = make_sequence(model, 1)
        sw = writer.sequence("s1", **row).__enter__()
        sw.add_layer(0, **layers[0])
        os._exit(9)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True)
    assert proc.returncode == 9, proc.stderr.decode()
    assert (tmp_path / "seq" / "s1.arrow.tmp").exists()
    assert validate_store(tmp_path) == [] and open_store(tmp_path).sequence_ids == ["s0"]
    with TraceWriter(tmp_path, model) as writer:  # the dead process's lock is gone
        assert not list(tmp_path.rglob("*.tmp"))
        assert writer.has("s0") and not writer.has("s1")
        write_sequence(writer, "s1", *make_sequence(model, 1))
    assert validate_store(tmp_path) == []


def test_sequence_ids_are_sanitized(tmp_path: Path, model: ModelMeta):
    row, layers = make_sequence(model, 0)
    with TraceWriter(tmp_path, model) as writer:
        for evil in ("../escape", "a/../../b", "/abs", ""):
            with pytest.raises(StoreError, match="sequence_id"):
                writer.sequence(evil, **row)
        write_sequence(writer, "task/1k dé:0", row, layers)
        write_sequence(writer, ".hidden", row, layers)
    files = sorted(p.name for p in (tmp_path / "seq").iterdir())
    assert len(files) == 2 and all(not f.startswith(".") for f in files)
    assert all(set(f) <= set("abcdefghijklmnopqrstuvwxyz0123456789._-") for f in files)
    store = open_store(tmp_path)
    np.testing.assert_array_equal(store["task/1k dé:0"].keys(0, 0), layers[0]["keys"][0])
    # A manifest pointing outside the store is refused by reader and validator alike.
    rewrite_manifest(tmp_path, lambda rows: rows[0].update(file="../model.json"))
    with pytest.raises(StoreError, match="field 'file' is '../model.json'"):
        open_store(tmp_path)["task/1k dé:0"]
    assert any("field 'file' is '../model.json'" in p for p in validate_store(tmp_path))


# --------------------------------------------------------------------------- validation


def test_validate_catches_truncated_file(store_path: Path):
    f = store_path / "seq" / "s1.arrow"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    problems = validate_store(store_path)
    assert any(p.startswith("seq/s1.arrow: file has") and "expected n_bytes" in p
               for p in problems)
    assert any("seq/s1.arrow: not a readable Arrow IPC file" in p for p in problems)
    assert not any("s0" in p for p in problems)


def test_validate_catches_flipped_byte(store_path: Path):
    f = store_path / "seq" / "s0.arrow"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    problems = validate_store(store_path)
    assert problems and all(p.startswith("seq/s0.arrow: field 'checksum'") for p in problems)
    assert validate_store(store_path, check_data=False) == []


def test_validate_catches_wrong_schema_version(store_path: Path):
    doc = json.loads((store_path / "model.json").read_text())
    doc["schema_version"] = SCHEMA_VERSION + 1
    (store_path / "model.json").write_text(json.dumps(doc))
    assert validate_store(store_path) == [
        f"model.json: field 'schema_version' is {SCHEMA_VERSION + 1}, expected {SCHEMA_VERSION}"
    ]
    with pytest.raises(StoreError, match="schema_version"):
        open_store(store_path)


def test_validate_catches_nan_with_valid_checksum(store_path: Path):
    """A NaN written with a correct checksum is found by the NaN scan, not the checksum."""
    f = store_path / "seq" / "s0.arrow"
    tf = TensorFile(f, "s0")
    tensors = {name: np.array(tf.read(name)) for name in tf.index}
    del tf
    tensors["k/1/0"][3, 2] = np.nan
    write_tensor_file(f, tensors, "s0")
    import hashlib
    digest = "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest()
    rewrite_manifest(store_path, lambda rows: rows[0].update(checksum=digest,
                                                             n_bytes=f.stat().st_size))
    assert validate_store(store_path) == [
        "seq/s0.arrow: field 'keys' of layer 1 kv head 0 holds 1 NaN and 0 Inf value(s), "
        "expected finite values"
    ]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda r: r.update(context_end=r["question_start"] + 1), "field 'context_end' = 23"),
        (lambda r: r.update(question_end=r["prompt_length"] + 1), "field 'question_end' = 31"),
        (lambda r: r["query_positions"].reverse(), "'query_positions' is not sorted"),
        (lambda r: r["query_positions"].__setitem__(-1, 40), "expected positions in [0, "),
        (lambda r: r["query_roles"].__setitem__(0, "bogus"), "'query_roles' holds ['bogus']"),
        (lambda r: r["query_roles"].__setitem__(-1, "context_window"), "marks position(s) [39]"),
        (lambda r: r["token_ids"].pop(), "field 'token_ids' has length 39, expected"),
        (lambda r: r.update(dtype="float16"), "field 'dtype' is 'float16', expected 'float32'"),
    ],
)
def test_validate_catches_bad_manifest_rows(store_path: Path, change, expected: str):
    rewrite_manifest(store_path, lambda rows: change(rows[1]))
    problems = validate_store(store_path)
    assert problems and all(p.startswith("manifest.parquet: row 1 (sequence 's1')")
                            for p in problems)
    assert any(expected in p for p in problems), problems


def test_validate_checks_h2o_invariants(tmp_path: Path, model: ModelMeta):
    row, layers = make_sequence(model, 0)
    layers[1]["h2o"][2] *= 0.5
    with TraceWriter(tmp_path, model) as writer:
        write_sequence(writer, "s0", row, layers)
    assert validate_store(tmp_path) == [
        "seq/s0.arrow: field 'h2o' of layer 1 head 2 sums to 15, expected prompt_length = 30 "
        "(each prefill query spreads one unit of attention)"
    ]


def test_validate_missing_store_and_files(tmp_path: Path, store_path: Path):
    assert validate_store(tmp_path / "nothing")[0].endswith("not a directory, expected a "
                                                            "trace store")
    (store_path / "seq" / "s1.arrow").unlink()
    assert validate_store(store_path) == [
        "seq/s1.arrow: file is missing (listed for sequence 's1' in manifest.parquet)"
    ]


# --------------------------------------------------------------------------- CLI


def test_cli_validate_exit_codes(store_path: Path, tmp_path: Path, capsys):
    assert cli_main(["validate", str(store_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK ") and "2 sequence(s)" in out and out.count("\n") == 1
    f = store_path / "seq" / "s0.arrow"
    f.write_bytes(f.read_bytes()[:-10])
    assert cli_main(["validate", str(store_path)]) == 1
    captured = capsys.readouterr()
    assert "seq/s0.arrow" in captured.out and "FAILED" in captured.err
    assert cli_main(["validate", str(tmp_path / "missing")]) == 1


# --------------------------------------------------------------------------- memory


def _rss() -> int:
    import psutil  # a test extra: the measurement must not be skipped

    return psutil.Process().memory_info().rss


def test_reading_one_head_keeps_memory_bounded(tmp_path: Path):
    model = make_model(n_layers=2, n_heads=4, n_kv_heads=4, head_dim=64, hidden_size=256)
    n_pos = 10_000
    rng = np.random.default_rng(0)
    row, _ = make_sequence(model, 0, n_positions=n_pos, prompt_length=n_pos - 8)
    with TraceWriter(tmp_path, model) as writer, writer.sequence("big", **row) as sw:
        n_q = len(row["query_positions"])
        for layer in range(model.n_layers):
            h2o = np.zeros((4, n_pos), np.float32)  # valid: one unit per prefill query
            h2o[:, :n_pos - 8] = 1.0
            sw.add_layer(
                layer,
                keys=rng.standard_normal((4, n_pos, 64), np.float32),
                values=rng.standard_normal((4, n_pos, 64), np.float32),
                queries=np.zeros((4, n_q, 64), np.float32),
                outputs=np.zeros((4, n_q, 64), np.float32),
                h2o=h2o,
            )
    size = (tmp_path / "seq" / "big.arrow").stat().st_size
    assert size > 40e6
    gc.collect()
    seq = open_store(tmp_path)["big"]
    seq.h2o_scores(0, 0)  # open the file and parse its index
    rss0 = _rss()
    total = float(seq.keys(1, 2).sum()) + float(seq.values(1, 2).sum())  # touches 5 MB
    grown = _rss() - rss0
    assert np.isfinite(total)
    assert grown < 8e6, f"reading one head grew RSS by {grown / 1e6:.1f} MB ({size / 1e6:.0f} MB)"
    # Control: touching every head maps the whole file, so the measurement can see it.
    for layer in range(2):
        for h in range(4):
            total += float(seq.keys(layer, h).sum()) + float(seq.values(layer, h).sum())
    assert _rss() - rss0 > 25e6
