"""Hostile and careless inputs, one generator per family (issue families 1-4 and 8).

Each generator returns cases ``{"name", "family", "argv", "expect"}``: ``argv`` is a
``tracesim`` command line, ``expect`` the substrings its one-line message must contain (the
file and the field). :func:`build_inputs` writes the inputs the cases read under one root.

Run as ``python -m tests.hostile_cases CASES.json RESULTS.json`` (by
``tests/test_hostile_input.py``, under a memory cap), it runs every case in-process with a
10 s alarm and writes ``{"cases": [{name, code, message, seconds}], "vmhwm_kb": N}``: one
interpreter start for all cases, and the peak resident memory read from /proc/self/status.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from tests.hostile_round3 import build_round3, peers_cases, product_cases, side_input_cases

Case = dict[str, Any]
_GRID = {"score": "snapkv", "design": "topk", "budget": 0.5,
         "score_params": {"snapkv": {"window": 8}}}


def laughs(levels: int = 9, width: int = 9) -> str:
    """A flow-style "billion laughs": ``width ** levels`` strings from a few hundred bytes."""
    parts = ["&l0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        parts.append(f"&l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]")
    return "[" + ", ".join(parts) + "]"


def _spec(root: Path, name: str, doc: dict[str, Any] | str) -> str:
    path = root / "specs" / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def build_inputs(root: Path) -> dict[str, str]:
    """Write the inputs every case reads; return their paths by role."""
    from tests.replay_fixtures import build_store
    from tracesim.export import export_results

    root.mkdir(parents=True, exist_ok=True)
    (root / "specs").mkdir(exist_ok=True)
    store = build_store(root / "store", n_seqs=2, n_layers=2, n_heads=2, n_kv=1, d=8)
    results = root / "results"  # a replay output as the commands see it (files only)
    results.mkdir()
    table = pa.table({"config_id": ["a", "b"], "score": ["snapkv", "snapkv"],
                      "design": ["topk", "poisson"], "budget": [0.5, 0.5],
                      "sequence_id": ["seq0", "seq0"], "err2": [0.1, 0.2]})
    pq.write_table(table, results / "replay.parquet")
    (results / "summary.json").write_text(json.dumps({"store": str(store), "seeds": 2}))
    export_results(results, root / "export", "csv")  # an earlier export (carries its marker)
    deep = root / "deep-results"  # a results directory whose summary.json is 100000 deep
    deep.mkdir()
    shutil.copyfile(results / "replay.parquet", deep / "replay.parquet")
    (deep / "summary.json").write_text("[" * 100_000 + "]" * 100_000)
    dup = root / "dup-store"  # model.json with "scaling" twice (the last would win)
    shutil.copytree(store, dup)
    text = (dup / "model.json").read_text()
    (dup / "model.json").write_text(text.replace('"scaling":', '"scaling": 1.0, "scaling":', 1))
    loop = root / "loop-store"  # seq/seq0.arrow is a symlink loop
    shutil.copytree(store, loop)
    (loop / "seq" / "seq0.arrow").unlink()
    os.symlink(loop / "seq" / "loop-b", loop / "seq" / "seq0.arrow")
    os.symlink(loop / "seq" / "seq0.arrow", loop / "seq" / "loop-b")
    os.mkfifo(root / "fifo.yaml")
    os.symlink(root / "specs" / "loop.yaml", root / "specs" / "loop.yaml")
    grid = _spec(root, "evict.yaml", {"grid": _GRID, "seeds": 1})
    round3 = build_round3(root, store)
    return {**round3, "root": str(root), "store": str(store), "results": str(results),
            "export": str(root / "export"), "deep": str(deep), "dup": str(dup),
            "loop": str(loop), "fifo": str(root / "fifo.yaml"), "grid": grid}


def _sweep(p: dict[str, str], **kw: Any) -> dict[str, Any]:
    return {"store": p["store"], "layers": [0], "seeds": 2, "grid": _GRID,
            "output": str(Path(p["root"]) / "sweep-out"), **kw}


def _tiers(p: dict[str, str], **kw: Any) -> dict[str, Any]:
    return {"store": p["store"], "grid": {**_GRID, "design": "poisson"}, "seeds": 2,
            "layers": [0], "schedulers": ["none"], "fetch_budgets": [0.0], **kw}


def _out(p: dict[str, str], name: str) -> str:
    return str(Path(p["root"]) / "outs" / name)


def bomb_cases(p: dict[str, str]) -> list[Case]:
    """Family 1: alias bombs, a 200k-alias grid, deep documents, duplicate keys."""
    root, out = Path(p["root"]), []
    base = yaml.safe_dump(_sweep(p), sort_keys=False)
    for field in ("name", "version", "seeds"):
        text = f"{field}: {laughs()}\n" + "".join(
            line + "\n" for line in base.splitlines() if not line.startswith(f"{field}:"))
        spec = _spec(root, f"laughs-{field}.yaml", text)
        out.append({"name": f"laughs in {field}", "argv": ["sweep", spec, "--dry-run",
                                                           "--no-calibrate"],
                    "expect": [Path(spec).name, field, "alias"]})
    score = _spec(root, "laughs-score.yaml", base.replace("score: snapkv",
                                                          f"score: {laughs()}"))
    out.append({"name": "laughs in grid.score", "argv": ["sweep", score, "--dry-run",
                                                         "--no-calibrate"],
                "expect": ["laughs-score.yaml", "grid.score", "alias"]})
    tiers = _spec(root, "tiers-laughs.yaml", yaml.safe_dump(_tiers(p)).replace(
        "seeds: 2", f"seeds: {laughs()}"))
    out.append({"name": "tiers laughs in seeds", "argv": ["tiers", "--spec", tiers, "--out",
                                                          _out(p, "t-laughs")],
                "expect": ["tiers-laughs.yaml", "seeds", "alias"]})
    evict = _spec(root, "evict-laughs.yaml", f"grid: {{score: {laughs()}, design: topk, "
                                             "budget: 0.5}\n")
    out.append({"name": "evict laughs in grid.score",
                "argv": ["evict", p["store"], "--grid", evict, "--out", _out(p, "e-laughs")],
                "expect": ["evict-laughs.yaml", "grid.score", "alias"]})
    one = json.dumps({"score": ["snapkv", "h2o"], "design": ["topk", "poisson"],
                      "budget": [0.1, 0.2, 0.3, 0.4, 0.5]})
    aliases = _spec(root, "aliases.yaml", base.split("grid:")[0] + f"grid: [&g {one}, "
                    + "*g, " * 200_000 + "*g]\n")
    out.append({"name": "grid of 200k aliases", "argv": ["sweep", aliases, "--dry-run",
                                                         "--no-calibrate"],
                "expect": ["aliases.yaml", "grid[1]", "alias"]})
    deep = _spec(root, "tiers-deep.yaml", "grid: " + "[" * 5000 + "]" * 5000 + "\n")
    out.append({"name": "tiers spec 5000 deep", "argv": ["tiers", "--spec", deep, "--out",
                                                         _out(p, "t-deep")],
                "expect": ["tiers-deep.yaml", "grid", "nesting"]})
    out.append({"name": "summary.json 100000 deep",
                "argv": ["report", p["deep"], "--out", _out(p, "r-deep")],
                "expect": ["summary.json", "nesting"]})
    dup = _spec(root, "dup-seeds.yaml", base + "seeds: 100000\n")  # base has seeds: 2
    out.append({"name": "duplicate YAML key seeds", "argv": ["sweep", dup, "--dry-run",
                                                             "--no-calibrate"],
                "expect": ["dup-seeds.yaml", "'seeds'", "twice"]})
    out.append({"name": "duplicate JSON key scaling",
                "argv": ["replay", p["dup"], "--seeds", "2", "--window", "8", "--no-progress",
                         "--out", _out(p, "rp-dup")],
                "expect": ["model.json", "'scaling'", "twice"]})
    return out


def special_file_cases(p: dict[str, str]) -> list[Case]:
    """Family 2: devices, FIFOs, directories, /proc, symlink loops and oversized files."""
    root = Path(p["root"])
    big = root / "specs" / "big.yaml"
    big.write_text("#" * (2 << 20) + "\n")
    proc = _spec(root, "prereg-proc.yaml", _sweep(p, prereg="/proc/self/status"))
    grid, store = p["grid"], p["store"]
    return [
        {"name": "tiers --spec /dev/zero", "argv": ["tiers", "--spec", "/dev/zero", "--out",
                                                    _out(p, "t-zero")],
         "expect": ["/dev/zero", "device"]},
        {"name": "sweep /dev/zero", "argv": ["sweep", "/dev/zero", "--dry-run"],
         "expect": ["/dev/zero", "device"]},
        {"name": "evict --grid /dev/zero", "argv": ["evict", store, "--grid", "/dev/zero",
                                                    "--out", _out(p, "e-zero")],
         "expect": ["/dev/zero", "device"]},
        {"name": "evict --tiers-spec /dev/zero",
         "argv": ["evict", store, "--grid", grid, "--fetch", "random", "--tiers-spec",
                  "/dev/zero", "--out", _out(p, "e-tzero")],
         "expect": ["--tiers-spec", "/dev/zero", "device"]},
        {"name": "frontier --rules /dev/zero",
         "argv": ["frontier", p["results"], "--rules", "/dev/zero", "--out",
                  _out(p, "f-zero")],
         "expect": ["/dev/zero", "device"]},
        {"name": "capture --prompts /dev/zero",
         "argv": ["capture", "--prompts", "/dev/zero", "--out", _out(p, "c-zero")],
         "expect": ["/dev/zero", "device"]},
        {"name": "sweep spec FIFO", "argv": ["sweep", p["fifo"], "--dry-run"],
         "expect": ["fifo.yaml", "FIFO"]},
        {"name": "tiers spec directory", "argv": ["tiers", "--spec", str(root / "specs"),
                                                  "--out", _out(p, "t-dir")],
         "expect": ["specs", "directory"]},
        {"name": "prereg in /proc", "argv": ["sweep", proc, "--dry-run", "--no-calibrate"],
         "expect": ["prereg-proc.yaml", "prereg", "/proc"]},
        {"name": "evict grid symlink loop",
         "argv": ["evict", store, "--grid", str(root / "specs" / "loop.yaml"), "--out",
                  _out(p, "e-loop")],
         "expect": ["loop.yaml", "symlink loop"]},
        {"name": "sweep spec 2 MB", "argv": ["sweep", str(big), "--dry-run"],
         "expect": ["big.yaml", "bytes"]},
    ]


def count_cases(p: dict[str, str]) -> list[Case]:
    """Family 3: counts without a cap, in every spelling."""
    root, store = Path(p["root"]), p["store"]
    seeds = _spec(root, "seeds-list.yaml", _sweep(p, seeds=list(range(100_001))))
    tiers = _spec(root, "tiers-seeds.yaml", _tiers(p, seeds=list(range(100_000))))
    page = _spec(root, "page.yaml", _sweep(p, grid={**_GRID, "summary_page": 10**30}))
    replay = ["replay", store, "--seeds", "2", "--window", "8", "--no-progress"]
    return [
        {"name": "sweep seed list 100001", "argv": ["sweep", seeds, "--dry-run",
                                                    "--no-calibrate"],
         "expect": ["seeds-list.yaml", "seeds", "100000"]},
        {"name": "tiers seed list 100000", "argv": ["tiers", "--spec", tiers, "--out",
                                                    _out(p, "t-seeds")],
         "expect": ["tiers-seeds.yaml", "seeds", "4096"]},
        {"name": "replay --layers 30000",
         "argv": [*replay, "--layers", ",".join(map(str, range(30_000))), "--out",
                  _out(p, "rp-layers")], "expect": ["--layers", "4096"]},
        {"name": "replay --layers repeated", "argv": [*replay, "--layers", "0,0", "--out",
                                                      _out(p, "rp-dupl")],
         "expect": ["--layers", "repeats"]},
        {"name": "replay --sequences repeated",
         "argv": [*replay, "--sequences", "seq0,seq0", "--out", _out(p, "rp-dups")],
         "expect": ["--sequences", "repeats"]},
        {"name": "synth --sequences 1e9",
         "argv": ["synth", "--positions", "4096", "--sequences", str(10**9), "--out",
                  _out(p, "sy-seq")], "expect": ["--sequences", "10000"]},
        {"name": "synth --seed 1e30", "argv": ["synth", "--positions", "4096", "--seed",
                                               str(10**30), "--out", _out(p, "sy-seed")],
         "expect": ["--seed", "4294967295"]},
        {"name": "synth --positions 1e12", "argv": ["synth", "--positions", str(10**12),
                                                    "--out", _out(p, "sy-pos")],
         "expect": ["--positions", "1048576"]},
        {"name": "replay --summary-page 1e30",
         "argv": [*replay, "--summary-page", str(10**30), "--out", _out(p, "rp-page")],
         "expect": ["--summary-page", "1048576"]},
        {"name": "replay --schedule decode:1e30",
         "argv": [*replay, "--schedule", "decode:" + str(10**30), "--out",
                  _out(p, "rp-sched")], "expect": ["--schedule", "decode:K", "1048576"]},
        {"name": "grid summary_page 1e30", "argv": ["sweep", page, "--dry-run",
                                                    "--no-calibrate"],
         "expect": ["page.yaml", "summary_page"]},
        {"name": "capture --layers 0-999999", "argv": ["capture", "--layers", "0-999999",
                                                       "--out", _out(p, "c-layers")],
         "expect": ["--layers", "4095"]},
        {"name": "evict --seeds 1e9", "argv": ["evict", store, "--grid", p["grid"], "--seeds",
                                               str(10**9), "--out", _out(p, "e-seeds")],
         "expect": ["--seeds", "100000"]},
        {"name": "adversary --seeds 1e9", "argv": ["adversary", store, "--seeds", str(10**9),
                                                   "--out", _out(p, "a-seeds")],
         "expect": ["--seeds", "100000"]},
    ]


def output_cases(p: dict[str, str]) -> list[Case]:
    """Family 4: outputs that are, contain or lie inside an input; empty outputs."""
    root, store, results = Path(p["root"]), p["store"], p["results"]
    inside = _spec(root, "inside.yaml", _sweep(p, output=str(Path(store) / "sweep")))
    return [
        {"name": "export --out its input --overwrite",
         "argv": ["export", results, "--format", "csv", "--out", results, "--overwrite"],
         "expect": ["--out", "results"]},
        {"name": "export --out a store --overwrite",
         "argv": ["export", results, "--format", "csv", "--out", store, "--overwrite"],
         "expect": ["--out", "store", "--overwrite"]},
        {"name": "export --out ''", "argv": ["export", results, "--format", "csv", "--out",
                                             ""], "expect": ["--out", "empty"]},
        {"name": "export --out inside results",
         "argv": ["export", results, "--format", "csv", "--out", str(Path(results) / "x")],
         "expect": ["--out", "lies inside"]},
        {"name": "replay --out ''", "argv": ["replay", store, "--out", ""],
         "expect": ["--out", "empty"]},
        {"name": "replay --out the store", "argv": ["replay", store, "--out", store],
         "expect": ["--out", "trace store"]},
        {"name": "replay --out inside another store",
         "argv": ["replay", store, "--out", str(Path(p["dup"]) / "results")],
         "expect": ["--out", "lies inside the trace store", "dup-store"]},
        {"name": "sweep output inside the store",
         "argv": ["sweep", inside, "--dry-run", "--no-calibrate"],
         "expect": ["inside.yaml", "output", "trace store"]},
        {"name": "sweep --out contains the spec",
         "argv": ["sweep", inside, "--dry-run", "--no-calibrate", "--out", str(root)],
         "expect": ["inside.yaml", "output", "contains"]},
        {"name": "tiers --out in the store",
         "argv": ["tiers", store, "--spec", _spec(root, "tiers.yaml", _tiers(p)), "--out",
                  str(Path(store) / "seq")], "expect": ["--out", "trace store"]},
        {"name": "adversary --out the store", "argv": ["adversary", store, "--out", store],
         "expect": ["--out", "trace store"]},
        {"name": "report --out the results", "argv": ["report", results, "--out", results],
         "expect": ["--out", "results"]},
        {"name": "frontier --out the results",
         "argv": ["frontier", results, "--out", results], "expect": ["--out", "results"]},
        {"name": "synth --out ''", "argv": ["synth", "--positions", "4096", "--out", ""],
         "expect": ["--out", "empty"]},
        {"name": "replay into earlier results, refused",
         "argv": ["replay", store, "--seeds", "0", "--out", results], "expect": ["--seeds"]},
        {"name": "export a device over an earlier export",
         "argv": ["export", "/dev/zero", "--format", "csv", "--out", p["export"],
                  "--overwrite"], "expect": ["/dev/zero", "regular file"]},
    ]


def internal_error_cases(p: dict[str, str]) -> list[Case]:
    """Family 8: inputs that used to exit 1 ("internal error") or 0."""
    root, store = Path(p["root"]), p["store"]
    sp = _spec(root, "sp-int.yaml", _sweep(p, grid={**_GRID, "score_params": {"snapkv": 5}}))
    ap = _spec(root, "ap-int.yaml", _sweep(p, grid={**_GRID, "allocator": "adakv",
                                                    "allocator_params": {"adakv": 5}}))
    adv = ["adversary", store, "--window", "8", "--out", _out(p, "adv")]
    return [
        {"name": "symlink loop in seq/",
         "argv": ["replay", p["loop"], "--seeds", "2", "--window", "8", "--no-progress", "--out",
                  _out(p, "rp-loop")], "expect": ["seq/seq0.arrow", "symlink loop"]},
        {"name": "score_params int", "argv": ["sweep", sp, "--dry-run", "--no-calibrate"],
         "expect": ["sp-int.yaml", "grid.score_params.snapkv", "mapping"]},
        {"name": "allocator_params int", "argv": ["sweep", ap, "--dry-run", "--no-calibrate"],
         "expect": ["ap-int.yaml", "grid.allocator_params.adakv", "mapping"]},
        {"name": "adversary --layer 999", "argv": [*adv, "--layer", "999"],
         "expect": ["--layer", "999"]},
        {"name": "adversary --budget inf", "argv": [*adv, "--budget", "inf"],
         "expect": ["--budget", "inf"]},
        {"name": "adversary --grid nan,inf", "argv": [*adv, "--grid", "nan,inf"],
         "expect": ["--grid[0]", "nan"]},
        {"name": "frontier --alpha nan",
         "argv": ["frontier", p["results"], "--alpha", "nan", "--out", _out(p, "f-nan")],
         "expect": ["--alpha", "nan"]},
    ]


FAMILIES = {"1 bombs": bomb_cases, "2 special files": special_file_cases,
            "3 counts": count_cases, "4 outputs": output_cases,
            "8 internal errors": internal_error_cases,
            # round three (#32); capture prompts: tests/test_hostile_capture.py
            "9 products of sizes": product_cases, "10 peers and tiers": peers_cases,
            "11 report side inputs": side_input_cases}


def all_cases(p: dict[str, str]) -> list[Case]:
    """Every family's cases, each tagged with its family."""
    return [dict(c, family=fam) for fam, gen in FAMILIES.items() for c in gen(p)]


if __name__ == "__main__":  # pragma: no cover - run by tests/test_hostile_input.py
    from tests.fault_harness import run_cases

    doc = run_cases(json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(doc))
