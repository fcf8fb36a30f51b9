"""Deterministic mutations of a valid trace store and of a valid sweep spec (fault suite).

Each mutation is ``(name, label, apply)``: ``apply(root)`` damages the store (or writes the
spec) under ``root``; ``label`` is the file the error message must name.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tracesim.store.format import sha256_file

Mutation = tuple[str, str, Callable[[Path], None]]
SEQ = "seq/seq0.arrow"


def _edit_model(field: str, value) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        doc = json.loads((root / "model.json").read_text())
        doc[field] = value
        (root / "model.json").write_text(json.dumps(doc))
    return apply


def _edit_row(field: str, value, row: int = 0) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        table = pq.read_table(root / "manifest.parquet")
        col = table.column(field).to_pylist()
        col[row] = value(col[row]) if callable(value) else value
        i = table.schema.get_field_index(field)
        arr = pa.array(col, type=table.schema.field(field).type)
        pq.write_table(table.set_column(i, table.schema.field(field), arr),
                       root / "manifest.parquet")
    return apply


def _special(rel: str, kind: str) -> Callable[[Path], None]:
    """Replace ``rel`` by a FIFO, a symlink to /dev/zero, a directory, a symlink that leaves
    the store (to a valid copy), or an empty file."""
    def apply(root: Path) -> None:
        path = root / rel
        if kind == "outside":
            outside = root.parent / f"outside-{path.name}"
            shutil.copyfile(path, outside)
        path.unlink()
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "devzero":
            path.symlink_to("/dev/zero")
        elif kind == "dir":
            path.mkdir()
        elif kind == "outside":
            path.symlink_to(outside)
        elif kind == "empty":
            path.write_bytes(b"")
    return apply


def _bytes(rel: str, how: str, arg: int) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        path = root / rel
        data = bytearray(path.read_bytes())
        if how == "flip":
            pos = arg % len(data)
            data[pos] ^= 1 << (arg % 8)
        elif how == "truncate":
            data = data[: arg % len(data)]
        elif how == "append":
            data += b"\0" * arg
        elif how == "zero":
            data = bytearray(len(data))
        path.write_bytes(bytes(data))
    return apply


def _inject_inf(kind: str) -> Callable[[Path], None]:
    """Write Inf into a tensor and re-sign the file (checksum and n_bytes updated), so only
    the value check can catch it."""
    def apply(root: Path) -> None:
        from tracesim.store.tensorfile import TensorFile

        path = root / SEQ
        tf = TensorFile(path, SEQ)
        entry = tf.index[f"{kind}/0/0"]
        batch = tf._reader.get_batch(entry["batch"]).column(0)
        # locate the tensor's bytes inside the file by content
        raw = batch.to_numpy(zero_copy_only=False).tobytes()
        del tf, batch
        data = bytearray(path.read_bytes())
        start = data.find(raw)
        assert start >= 0
        data[start:start + 4] = np.array([np.inf], dtype="<f4").tobytes()
        path.write_bytes(bytes(data))
        _edit_row("checksum", sha256_file(path))(root)
    return apply


def _deep_index(root: Path) -> None:
    """A tensor file whose index JSON nests 100000 levels, re-signed in the manifest."""
    path = root / SEQ
    schema = pa.schema([pa.field("data", pa.uint8(), nullable=False)]).with_metadata(
        {b"tracesim.index": b'{"tensors": {}, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(pa.record_batch([pa.array([0], pa.uint8())], schema=schema))
    _edit_row("checksum", sha256_file(path))(root)
    _edit_row("n_bytes", path.stat().st_size)(root)


def store_mutations() -> list[Mutation]:
    rng = np.random.default_rng(12)
    out: list[Mutation] = []
    bad_ints = [0, -1, 10**9, 10**18, 1.5, "8", None, True, [], 1e9]
    for field in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_size"):
        for v in bad_ints:
            out.append((f"model.{field}={v!r}", "model.json", _edit_model(field, v)))
    for v in [0, -1.0, 1e30, float("inf"), float("nan"), "x", None, True, 1e300, 17.0]:
        out.append((f"model.scaling={v!r}", "model.json", _edit_model("scaling", v)))
    for v in ["float64", "bfloat16", "", None, 3]:
        out.append((f"model.dtype={v!r}", "model.json", _edit_model("dtype", v)))
    for v in [0, 2, "1", None]:
        out.append((f"model.schema_version={v!r}", "model.json",
                    _edit_model("schema_version", v)))
    for v in ["other-model", "", None]:
        out.append((f"model.model_id={v!r}", "model.json", _edit_model("model_id", v)))
    for v in [{"file": "../x"}, "o_proj.arrow", 7,
              {"file": "o_proj.arrow", "checksum": "sha256:" + "0" * 64, "n_bytes": 5}]:
        out.append((f"model.o_proj={v!r}", "o_proj" if isinstance(v, dict) and
                    v.get("n_bytes") == 5 else "model.json", _edit_model("o_proj", v)))

    def raw_model(data: bytes) -> Callable[[Path], None]:
        return lambda root: (root / "model.json").write_bytes(data)

    for kind in ("fifo", "devzero", "dir", "outside", "empty"):
        out.append((f"model.json as {kind}", "model.json", _special("model.json", kind)))
    out += [("model.json deep", "model.json", raw_model(b"[" * 100_000 + b"]" * 100_000)),
            ("model.json 2MB", "model.json", raw_model(b" " * (2 << 20) + b"{}")),
            ("model.json not utf-8", "model.json", raw_model(b"{\"a\": \"\xff\xfe\"}")),
            ("model.json list", "model.json", raw_model(b"[]")),
            ("model.json truncated", "model.json", raw_model(b"{\"format\": ")),
            ("model.json nested 40", "model.json",
             raw_model(json.dumps({"x": json.loads("[" * 40 + "]" * 40)}).encode()))]

    for kind in ("fifo", "devzero", "dir", "outside", "empty"):
        out.append((f"manifest as {kind}", "manifest.parquet",
                    _special("manifest.parquet", kind)))
    out += [("manifest garbage", "manifest.parquet",
             _bytes("manifest.parquet", "zero", 0)),
            ("manifest truncated", "manifest.parquet",
             _bytes("manifest.parquet", "truncate", 300))]
    rows = [("query_positions", lambda q: [-1, *q[1:]]),
            ("query_positions", lambda q: [*q[:-1], 10**6]),
            ("query_positions", lambda q: list(reversed(q))),
            ("n_positions", lambda n: n + 1), ("n_positions", lambda n: 10**12),
            ("n_positions", lambda n: -5), ("n_query", lambda n: n + 1),
            ("n_query", lambda n: 10**12), ("n_bytes", lambda n: n + 1),
            ("checksum", "sha256:" + "0" * 64), ("checksum", "x"),
            ("file", "../../etc/passwd"), ("file", "/etc/passwd"),
            ("file", "seq/../../x.arrow"), ("file", "seq/missing.arrow"),
            ("prompt_length", 0), ("prompt_length", lambda p: 10**6),
            ("question_start", lambda q: 10**6), ("model_id", "other"),
            ("dtype", "float64"), ("sequence_id", "seq1"),
            ("query_roles", lambda r: ["bogus", *r[1:]])]
    for field, value in rows:
        label = "manifest.parquet" if field != "file" or "missing" not in str(value) \
            else "seq/missing.arrow"
        if field == "n_bytes":
            label = SEQ
        out.append((f"manifest.{field}", label, _edit_row(field, value)))

    flips = rng.integers(0, 1 << 30, size=60)
    for i, pos in enumerate(flips):
        out.append((f"seq flip {i}", SEQ, _bytes(SEQ, "flip", int(pos))))
    for i, n in enumerate(rng.integers(0, 1 << 30, size=10)):
        out.append((f"seq truncate {i}", SEQ, _bytes(SEQ, "truncate", int(n))))
    for n in (1, 8, 4096):
        out.append((f"seq append {n}", SEQ, _bytes(SEQ, "append", n)))
    out.append(("seq zeroed", SEQ, _bytes(SEQ, "zero", 0)))
    for kind in ("fifo", "devzero", "dir", "outside", "empty"):
        out.append((f"seq as {kind}", SEQ, _special(SEQ, kind)))
    for kind in ("k", "v", "q", "o"):
        out.append((f"seq Inf in {kind}", SEQ, _inject_inf(kind)))
    out.append(("seq index nested 100000 deep", SEQ, _deep_index))

    for i, pos in enumerate(rng.integers(0, 1 << 30, size=8)):
        out.append((f"o_proj flip {i}", "o_proj.arrow", _bytes("o_proj.arrow", "flip",
                                                              int(pos))))
    out.append(("o_proj truncated", "o_proj.arrow", _bytes("o_proj.arrow", "truncate", 999)))
    for kind in ("fifo", "devzero", "dir", "outside", "empty"):
        out.append((f"o_proj as {kind}", "o_proj.arrow", _special("o_proj.arrow", kind)))
    return out


BASE_SPEC = {"store": "store", "layers": [0], "seeds": 2,
             "grid": {"score": ["snapkv"], "design": ["topk", "poisson"], "budget": [0.4],
                      "score_params": {"*": {"window": 8}}}}


def spec_mutations() -> list[tuple[str, str, object]]:
    """``(name, expected text in the message, spec doc or raw bytes)``."""
    def with_(**kw):
        doc = json.loads(json.dumps(BASE_SPEC))
        for key, value in kw.items():
            if key.startswith("grid_"):
                doc["grid"][key[5:]] = value
            else:
                doc[key] = value
        return doc

    big = [round(0.001 * i, 3) for i in range(1, 1000)]
    out: list[tuple[str, str, object]] = [
        ("seeds 1e9", "seeds", with_(seeds=10**9)),
        ("seed 2^64", "seeds", with_(seeds=[2**64])),
        ("seed -1", "seeds", with_(seeds=[-1])),
        ("seeds str", "seeds", with_(seeds="x")),
        ("seeds repeat", "seeds", with_(seeds=[1, 1])),
        ("seeds 0", "seeds", with_(seeds=0)),
        ("layers stop 1e10", "layers", with_(layers={"start": 0, "stop": 10**10})),
        ("layers 1e6", "layers", with_(layers=[10**6])),
        ("layers -1", "layers", with_(layers=[-1])),
        ("layers str", "layers", with_(layers="x")),
        ("layers empty", "layers", with_(layers=[])),
        ("layers beyond model", "layers", with_(layers=[7])),
        ("budget 2.0", "budget", with_(grid_budget=[2.0])),
        ("budget -0.5", "budget", with_(grid_budget=[-0.5])),
        ("budget str", "budget", with_(grid_budget=["x"])),
        ("budget empty", "budget", with_(grid_budget=[])),
        ("budget 1e30", "budget", with_(grid_budget=[10**30])),
        ("window 1e12", "window", with_(grid_score_params={"*": {"window": 10**12}})),
        ("window str", "window", with_(grid_score_params={"*": {"window": "x"}})),
        ("decode:1e20", "decode", with_(grid_schedule=["decode:" + "1" + "0" * 20])),
        ("decode:0", "decode", with_(grid_schedule=["decode:0"])),
        ("schedule bogus", "schedule", with_(grid_schedule=["bogus"])),
        # list(big): one object twice would be dumped as a YAML alias, which is refused first
        ("grid 10^6", "combinations", with_(grid_budget=big, grid_design_params={
            "poisson": {"mixture": list(big)}})),
        ("list 2000", "values", with_(grid_budget=[0.5] * 2000)),
        ("unknown score", "score", with_(grid_score=["nope"])),
        ("unknown key", "bogus", with_(bogus=1)),
        ("record bogus", "record", with_(record="x")),
        ("alpha 2", "alpha", with_(options={"alpha": 2.0})),
        ("layers_per_task 0", "layers_per_task", with_(partition={"layers_per_task": 0})),
        ("store missing", "store", with_(store="nowhere")),
        ("mixture nan", "mixture", with_(grid_design_params={"poisson": {"mixture": ".nan"}})),
        ("not utf-8", "UTF-8", b"store: \xff\xfe\n"),
        ("python tag", "YAML", b"store: !!python/object/apply:os.system ['true']\n"),
        ("deep yaml", "YAML", b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n"),
        ("yaml 2MB", "bytes", b"#" * (2 << 20) + b"\n"),
        ("empty", "mapping", b""),
        ("list", "mapping", b"[1, 2]\n"),
    ]
    return out
