"""Hostile inputs of round three (issue #32): products of sizes, peers and tiers parameters, and
the report's side inputs. Imported by ``tests/hostile_cases.py`` (same case format); the
capture prompts of round three need a tokenizer and live in ``tests/test_hostile_capture.py``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

Case = dict[str, Any]


def _copy_store(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _resign(store: Path, seq: Path) -> None:
    """Record the rewritten ``seq``'s size and sha256 in the manifest (a consistent forger)."""
    digest = "sha256:" + hashlib.sha256(seq.read_bytes()).hexdigest()
    manifest = pq.read_table(store / "manifest.parquet")
    rel = f"seq/{seq.name}"
    mine = [f == rel for f in manifest.column("file").to_pylist()]
    for name, value in (("n_bytes", seq.stat().st_size), ("checksum", digest)):
        column = [value if m else v for m, v in zip(mine, manifest.column(name).to_pylist(),
                                                    strict=True)]
        i = manifest.schema.get_field_index(name)
        manifest = manifest.set_column(i, manifest.schema.field(i),
                                       pa.array(column, manifest.schema.field(i).type))
    pq.write_table(manifest, store / "manifest.parquet")


def build_round3(root: Path, store: Path) -> dict[str, str]:
    """Stores with a hostile manifest or tensor index, and a damaged store (its seq0 file
    removed); returns their paths by role."""
    rows = _copy_store(store, root / "rows-store")  # 10**6 sequences in a small manifest
    ids = pa.array(["s"] * 1_000_000).dictionary_encode()
    pq.write_table(pa.table({"sequence_id": ids}), rows / "manifest.parquet")
    tokens = _copy_store(store, root / "tokens-store")  # 1.5e8 token ids, a few kB of zeros
    chunk = pa.ListArray.from_arrays(pa.array([0, 10_000_000], pa.int32()),
                                     pa.array(np.zeros(10_000_000, np.int32)))
    table = pa.table({"token_ids": chunk})
    with pq.ParquetWriter(tokens / "manifest.parquet", table.schema) as writer:
        for _ in range(15):
            writer.write_table(table)
    index = _copy_store(store, root / "index-store")  # a 17 MiB string in a tensor index
    seq = next((index / "seq").glob("*.arrow"))
    with pa.memory_map(str(seq)) as src:
        original = pa.ipc.open_file(src).read_all()
    meta = dict(original.schema.metadata or {})
    meta[b"padding"] = b"x" * (17 << 20)
    big = original.replace_schema_metadata(meta)
    with pa.OSFile(str(seq), "wb") as sink, pa.ipc.new_file(sink, big.schema) as writer:
        writer.write_table(big)
    _resign(index, seq)
    damaged = _copy_store(store, root / "damaged-store")
    next((damaged / "seq").glob("*.arrow")).unlink()
    spec = root / "specs" / "tokens-sweep.yaml"
    spec.write_text(yaml.safe_dump({
        "store": str(tokens), "layers": [0], "seeds": 2,
        "output": str(root / "sweep-tokens"),
        "grid": {"score": "snapkv", "design": "topk", "budget": 0.5}}, sort_keys=False))
    return {"tokens_spec": str(spec), "rows_store": str(rows), "tokens_store": str(tokens),
            "index_store": str(index), "damaged_store": str(damaged)}


def _out(p: dict[str, str], name: str) -> str:
    return str(Path(p["root"]) / "outs" / name)


def product_cases(p: dict[str, str]) -> list[Case]:
    """Family 9: each size within its bound, their product not (synth, manifests, indexes)."""
    replay = ["replay", "--seeds", "2", "--window", "8", "--no-progress"]
    synth = ["synth", "--quiet", "--no-o-proj"]
    return [
        {"name": "synth 2^20 positions x 4096 layers x 10000 sequences",
         "argv": [*synth, "--positions", str(1 << 20), "--layers", "4096", "--sequences",
                  "10000", "--out", _out(p, "sy-prod")],
         "expect": ["--positions", "--layers", "--sequences", "store written", "1.0 TiB"]},
        {"name": "synth llama 4096 layers of o_proj",
         "argv": ["synth", "--quiet", "--shape", "llama", "--positions", "4096", "--layers",
                  "4096", "--out", _out(p, "sy-oproj")],
         "expect": ["--layers 4096", "memory", "16.0 GiB"]},
        {"name": "synth llama 2^20 positions x 2000 sequences",
         "argv": [*synth, "--shape", "llama", "--positions", str(1 << 20), "--sequences",
                  "2000", "--out", _out(p, "sy-seq")],
         "expect": ["--sequences 2000", "store written"]},
        {"name": "peers: manifest of 10^6 sequences",
         "argv": ["peers", p["rows_store"], "--out", _out(p, "pe-rows")],
         "expect": ["manifest.parquet", "rows", "100000"]},
        {"name": "replay: manifest of 10^6 sequences",
         "argv": [*replay, p["rows_store"], "--out", _out(p, "rp-rows")],
         "expect": ["manifest.parquet", "rows", "100000"]},
        {"name": "sweep: 1.5e8 token ids",
         "argv": ["sweep", p["tokens_spec"], "--dry-run", "--no-calibrate"],
         "expect": ["manifest.parquet", "list items", str(1 << 27)]},
        {"name": "replay: 1.5e8 token ids",
         "argv": [*replay, p["tokens_store"], "--out", _out(p, "rp-tokens")],
         "expect": ["manifest.parquet", "list items", str(1 << 27)]},
        {"name": "replay: 17 MiB string in a tensor index",
         "argv": [*replay, p["index_store"], "--out", _out(p, "rp-index")],
         "expect": ["seq/", "index", "16.0 MiB"]},
    ]


def _tiers_spec(p: dict[str, str], name: str, **memory: Any) -> str:
    doc = {"store": p["store"], "seeds": 2, "layers": [0], "schedulers": ["none"],
           "fetch_budgets": [0.0], "memory": memory,
           "grid": {"score": "snapkv", "design": "poisson", "budget": 0.5,
                    "score_params": {"snapkv": {"window": 8}}}}
    path = Path(p["root"]) / "specs" / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def peers_cases(p: dict[str, str]) -> list[Case]:
    """Family 10: peers and tiers parameters, and a per-step proxy the store cannot serve."""
    peers = ["peers", p["store"], "--quiet", "--seeds", "2"]
    lowrank = Path(p["root"]) / "specs" / "lowrank.yaml"
    lowrank.write_text(yaml.safe_dump({
        "store": p["store"], "layers": [0], "seeds": 2,
        "output": str(Path(p["root"]) / "sweep-lowrank"),
        "grid": {"score": "perstep", "design": "poisson", "budget": 0.5, "schedule": "step",
                 "score_params": {"perstep": {"proxy": "lowrank:64"}}}}, sort_keys=False))
    return [
        {"name": "peers quest page 1e30",
         "argv": [*peers, "--peer", "quest", "--params", '{"quest": {"page": 1e30}}',
                  "--out", _out(p, "pe-page30")], "expect": ["quest", "page", "1048576"]},
        {"name": "peers quest page 10^12",
         "argv": [*peers, "--peer", "quest", "--params", json.dumps({"quest": {"page": 10**12}}),
                  "--out", _out(p, "pe-page12")], "expect": ["quest", "page", "1048576"]},
        {"name": "peers magicpig local 10^30",
         "argv": [*peers, "--peer", "magicpig", "--params",
                  json.dumps({"magicpig": {"local": 10**30}}), "--out", _out(p, "pe-local")],
         "expect": ["magicpig", "local", "1048576"]},
        {"name": "peers --layers 0:100000000",
         "argv": [*peers, "--layers", "0:100000000", "--out", _out(p, "pe-lay")],
         "expect": ["--layers", "4096"]},
        {"name": "peers --layers beyond the store",
         "argv": [*peers, "--layers", "0:5", "--out", _out(p, "pe-lay5")],
         "expect": ["--layers", "2 layers"]},
        {"name": "peers --layers 1,4095",
         "argv": [*peers, "--layers", "1,4095", "--out", _out(p, "pe-lay4095")],
         "expect": ["--layers", "layer 4095", "2 layers"]},
        {"name": "peers --peer quest,quest",
         "argv": [*peers, "--peer", "quest,quest", "--out", _out(p, "pe-dup")],
         "expect": ["--peer", "'quest' repeats"]},
        {"name": "peers --seeds 10^6",
         "argv": ["peers", p["store"], "--seeds", str(10**6), "--out", _out(p, "pe-seeds")],
         "expect": ["--seeds", "4096"]},
        {"name": "tiers page 10^12",
         "argv": ["tiers", "--spec", _tiers_spec(p, "tiers-page.yaml", page=10**12), "--out",
                  _out(p, "t-page")], "expect": ["tiers-page.yaml", "page", "1048576"]},
        {"name": "sweep lowrank:64 on head_dim 8",
         "argv": ["sweep", str(lowrank), "--dry-run", "--no-calibrate"],
         "expect": ["lowrank", "head_dim = 8", "store"]},
    ]


def side_input_cases(p: dict[str, str]) -> list[Case]:
    """Family 11: the report's --traces store verified before use."""
    report = ["report", p["results"], "--out"]
    return [
        {"name": "report --traces damaged store",
         "argv": [*report, _out(p, "rep-dmg"), "--traces", p["damaged_store"]],
         "expect": ["--traces", "damaged-store", "validation", "missing"]},
        {"name": "report --traces store with 10^6 rows",
         "argv": [*report, _out(p, "rep-rows"), "--traces", p["rows_store"]],
         "expect": ["--traces", "rows-store", "100000"]},
        {"name": "report --traces store with a duplicate key",
         "argv": [*report, _out(p, "rep-dup"), "--traces", p["dup"]],
         "expect": ["--traces", "dup-store", "scaling"]},
        {"name": "report --traces store with a symlink loop",
         "argv": [*report, _out(p, "rep-loop"), "--traces", p["loop"]],
         "expect": ["--traces", "loop-store", "symlink"]},
        {"name": "report --traces not a store",
         "argv": [*report, _out(p, "rep-none"), "--traces", str(Path(p["root"]) / "specs")],
         "expect": ["--traces", "specs", "model.json"]},
        {"name": "report --traces 1.5e8 token ids",
         "argv": [*report, _out(p, "rep-tok"), "--traces", p["tokens_store"]],
         "expect": ["--traces", "tokens-store", "list items"]},
        {"name": "report --traces 17 MiB index",
         "argv": [*report, _out(p, "rep-idx"), "--traces", p["index_store"]],
         "expect": ["--traces", "index-store", "validation"]},
    ]
