"""Hostile and careless input, round two: families 5-7, one generator each.

Same shape as ``tests/hostile_cases.py`` (whose child runner runs them): each case is
``{"name", "argv", "expect"}``, a ``tracesim`` command line and the substrings its one-line
message must contain (the file and the field). :func:`build_inputs` writes what they read:
real replay outputs (signed by replay itself), tampered copies of them, and re-signed stores
that break the documented h2o invariants.

Run as ``python -m tests.integrity_cases CASES.json RESULTS.json`` (by
``tests/test_integrity.py``, under a memory cap).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tests.fault_harness import run_cases

Case = dict[str, Any]
_REPLAY = ["--score", "snapkv", "--design", "topk,poisson", "--window", "8", "--seeds", "2",
           "--layers", "0", "--no-progress"]


def _cli(argv: list[str]) -> None:
    from tracesim.app.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(argv)
    assert code == 0, argv


def _store(path: Path, forge=None) -> Path:
    """A small store; ``forge(arrays, prompt_length, rng)`` edits each layer.

    Keys are edited before the writer sees them. The writer refuses invalid h2o scores, so
    forged scores are written valid, then patched into the tensor file's bytes and the
    manifest's checksums recomputed: what a re-signed forgery looks like.
    """
    from tests import replay_fixtures as rf
    from tracesim.store.format import sha256_file

    orig, patches = rf.synthetic_layer_arrays, []

    def forged(rng, **kw):
        arrays = orig(rng, **kw)
        if forge is not None:
            h2o = arrays["h2o"].copy()
            forge(arrays, kw["prompt_length"], rng)
            patches.extend(zip(h2o, arrays["h2o"].astype(np.float32), strict=True))
            arrays["h2o"] = h2o
        return arrays

    rf.synthetic_layer_arrays = forged
    try:
        rf.build_store(path, n_seqs=2, n_layers=1, n_heads=2, n_kv=1, d=8, dtype="float16")
    finally:
        rf.synthetic_layer_arrays = orig
    todo = [(a.tobytes(), b.tobytes()) for a, b in patches if a.tobytes() != b.tobytes()]
    if todo:
        manifest = pq.read_table(path / "manifest.parquet")
        sums = []
        for name in manifest["file"].to_pylist():
            data = (path / name).read_bytes()
            for old, new in todo:
                data = data.replace(old, new)
            (path / name).write_bytes(data)
            sums.append(sha256_file(path / name))
        i = manifest.schema.get_field_index("checksum")
        pq.write_table(manifest.set_column(i, manifest.schema.field(i), pa.array(sums)),
                       path / "manifest.parquet")
    return path


def _negative(a, pl, rng):
    a["h2o"][:, 1] += a["h2o"][:, 0] + 2.0  # the sum is kept: only the sign rule is broken
    a["h2o"][:, 0] = -2.0


def _tenfold(a, pl, rng):
    a["h2o"] *= 10.0


def _after_prompt(a, pl, rng):
    a["h2o"][:, :pl] *= (pl - 1.0) / pl  # the sum is kept: one unit moved past the prompt
    a["h2o"][:, pl] += 1.0


def _huge_keys(a, pl, rng):
    a["keys"] = (rng.standard_normal(a["keys"].shape) * 2000.0).astype(a["keys"].dtype)


def _write(path: Path, table: pa.Table) -> None:
    pq.write_table(table, path)


def _tampered(src: Path, dst: Path, edit, *, resign: bool) -> str:
    """Copy the replay output ``src`` to ``dst`` with its table edited; re-sign on request."""
    from tracesim.integrity import sign_results

    shutil.copytree(src, dst)
    table = pq.read_table(dst / "replay.parquet")
    _write(dst / "replay.parquet", edit(table))
    if resign:
        sign_results(dst / "replay.parquet")
    return str(dst)


def _as_earlier_version(out: Path) -> None:
    """Rewrite a replay output as the single files earlier versions wrote (``replay.parquet``,
    ``configs.json``, ``summary.json`` with its record): the family-7 edits target that
    layout, which every reader still reads (the dataset's own edits: test_results_dataset)."""
    from tracesim.dataset_read import read_results
    from tracesim.integrity import RECORD_FIELDS, sign_results

    res = out / "results"
    pq.write_table(read_results(out), out / "replay.parquet")
    shutil.copyfile(res / "configs.json", out / "configs.json")
    summary = {k: v for k, v in json.loads((res / "summary.json").read_text()).items()
               if k not in RECORD_FIELDS}
    (out / "summary.json").write_text(json.dumps(summary))
    sign_results(out / "replay.parquet")
    shutil.rmtree(res)


def _set(table: pa.Table, name: str, values: pa.Array) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, values)


def build_inputs(root: Path) -> dict[str, str]:
    """Write every input the cases read; return their paths by role."""
    root.mkdir(parents=True, exist_ok=True)
    store = _store(root / "store")
    out = {"root": str(root), "store": str(store)}
    # family 5: earlier replay outputs with one file of the set replaced by a directory
    r0 = root / "replay"
    _cli(["replay", str(store), *_REPLAY, "--budget", "0.5", "--out", str(r0)])
    _as_earlier_version(r0)
    for name in ("configs.json", "summary.json"):
        d = root / f"blocked-{name}"
        shutil.copytree(r0, d)
        (d / name).unlink()
        (d / name).mkdir()
        out[f"blocked-{name}"] = str(d)
    other = root / "replay-other"  # the same store under another budget: foreign rows
    _cli(["replay", str(store), *_REPLAY, "--budget", "0.3", "--out", str(other)])
    _as_earlier_version(other)
    for name in ("frontier.md", "validity_rules.json"):
        d = root / f"frontier-{name}"
        d.mkdir()
        (d / name).mkdir()
        out[f"frontier-{name}"] = str(d)
    sweep = root / "sweep-blocked"  # an earlier sweep whose results/summary.json is a dir
    (sweep / "results" / "summary.json").mkdir(parents=True)
    shutil.copyfile(r0 / "replay.parquet", sweep / "results" / "results.parquet")
    spec = root / "sweep.yaml"
    spec.write_text(json.dumps({"store": str(store), "layers": [0], "seeds": 2,
                                "grid": {"score": "snapkv", "design": "topk", "budget": 0.5,
                                         "score_params": {"snapkv": {"window": 8}}},
                                "output": str(sweep)}))  # JSON is YAML
    out["sweep-spec"] = str(spec)
    adv = root / "adversary-blocked"
    adv.mkdir()
    (adv / "adversary.json").mkdir()
    out["adversary-blocked"] = str(adv)
    peers = root / "peers-blocked"
    peers.mkdir()
    (peers / "peers.json").mkdir()
    out["peers-blocked"] = str(peers)
    # family 6: a zero-row manifest; re-signed stores that break the h2o rules; huge keys
    empty = root / "empty-store"
    shutil.copytree(store, empty)
    manifest = pq.read_table(empty / "manifest.parquet")
    _write(empty / "manifest.parquet", manifest.slice(0, 0))
    out["empty"] = str(empty)
    for name, forge in (("negative", _negative), ("tenfold", _tenfold),
                        ("after-prompt", _after_prompt), ("huge-keys", _huge_keys)):
        out[name] = str(_store(root / f"store-{name}", forge))
    tiers = root / "tiers-huge.yaml"  # tiers exponentiates logits in its own kernel
    tiers.write_text(json.dumps({"store": out["huge-keys"], "seeds": 2, "layers": [0],
                                 "grid": {"score": "snapkv", "design": "poisson",
                                          "budget": 0.5,
                                          "score_params": {"snapkv": {"window": 8}}},
                                 "schedulers": ["none"], "fetch_budgets": [0.0]}))
    out["tiers-huge"] = str(tiers)
    # family 7: tampered copies of a real replay output
    t = pq.read_table(r0 / "replay.parquet")
    half = np.arange(t.num_rows) % 2 == 0
    nan_half = pc.if_else(pa.array(half), pa.scalar(float("nan")), t["err2"])
    foreign = pq.read_table(other / "replay.parquet")
    edits = {
        "duplicated": (lambda x: pa.concat_tables([x, x]), False),
        "duplicated-resigned": (lambda x: pa.concat_tables([x, x]), True),
        "appended": (lambda x: pa.concat_tables([x, foreign]), False),
        "appended-resigned": (lambda x: pa.concat_tables([x, foreign]), True),
        "wald-forged": (lambda x: _set(x, "wald_cov", pa.array(np.ones(x.num_rows))), False),
        "nan-half": (lambda x: _set(x, "err2", nan_half), False),
        "zero-rows": (lambda x: x.slice(0, 0), True),
        "missing-column": (lambda x: x.drop_columns(["wald_cov"]), True),
        "mistyped-column": (lambda x: _set(x, "err2", pc.cast(x["err2"], pa.string())), True),
    }
    for name, (edit, resign) in edits.items():
        out[name] = _tampered(r0, root / f"results-{name}", edit, resign=resign)
    unsigned = root / "results-unsigned"  # an older output: summary without the record
    shutil.copytree(r0, unsigned)
    doc = json.loads((unsigned / "summary.json").read_text())
    for k in ("results_file", "results_sha256", "n_rows", "config_ids"):
        doc.pop(k)
    (unsigned / "summary.json").write_text(json.dumps(doc))
    out["unsigned"] = str(unsigned)
    rows = root / "results-rows"  # the summary's row count edited, nothing else
    shutil.copytree(r0, rows)
    doc = json.loads((rows / "summary.json").read_text())
    doc["n_rows"] += 1
    (rows / "summary.json").write_text(json.dumps(doc))
    out["rows"] = str(rows)
    out["replay"], out["other"] = str(r0), str(other)
    return out


def _out(p: dict[str, str], name: str) -> str:
    return str(Path(p["root"]) / "outs" / name)


def output_set_cases(p: dict[str, str]) -> list[Case]:
    """Family 5: one file of a multi-file output cannot be written; nothing may change."""
    store = p["store"]
    cases = [{"name": f"replay with {name} a directory",
              "argv": ["replay", store, *_REPLAY, "--budget", "0.4", "--out", p[f"blocked-{name}"]],
              "expect": [name, "directory", "expected a regular file"]}
             for name in ("configs.json", "summary.json")]
    cases += [{"name": f"frontier with {name} a directory",
               "argv": ["frontier", p["replay"], "--out", p[f"frontier-{name}"]],
               "expect": [name, "directory", "expected a regular file"]}
              for name in ("frontier.md", "validity_rules.json")]
    cases.append({"name": "sweep with results/summary.json a directory",
                  "argv": ["sweep", p["sweep-spec"], "--no-calibrate", "--no-progress",
                           "--workers", "1"],
                  "expect": ["results/summary.json", "directory", "expected a regular file"]})
    cases.append({"name": "adversary with adversary.json a directory",
                  "argv": ["adversary", store, "--score", "h2o", "--budget", "0.3", "--seeds",
                           "2", "--layer", "0", "--out", p["adversary-blocked"]],
                  "expect": ["adversary.json", "directory", "expected a regular file"]})
    cases.append({"name": "peers with peers.json a directory",
                  "argv": ["peers", store, "--peer", "quest", "--seeds", "1", "--layers", "0",
                           "--quiet", "--out", p["peers-blocked"]],
                  "expect": ["peers.json", "directory", "expected a regular file"]})
    return cases


def silent_numbers_cases(p: dict[str, str]) -> list[Case]:
    """Family 6: stores that replay to silently different numbers."""
    cases = [{"name": "replay a zero-row manifest",
              "argv": ["replay", p["empty"], *_REPLAY, "--out", p["replay"]],
              "expect": ["manifest.parquet", "0 rows"]},
             {"name": "peers on a zero-row manifest",
              "argv": ["peers", p["empty"], "--out", _out(p, "peers-empty")],
              "expect": ["manifest.parquet", "0 rows"]}]
    for name, expect in (("negative", "negative"), ("tenfold", "sums to"),
                         ("after-prompt", "prompt_length")):
        cases.append({"name": f"re-signed store, h2o {name}",
                      "argv": ["replay", p[name], *_REPLAY, "--out", _out(p, f"r-{name}")],
                      "expect": ["seq/seq0.arrow", "'h2o'", expect]})
    cases.append({"name": "fp16 keys ~N(0, 2000^2)",
                  "argv": ["replay", p["huge-keys"], *_REPLAY, "--budget", "0.5", "--out",
                           _out(p, "r-huge")],
                  "expect": ["seq0", "'keys'", "exponent range"]})
    cases.append({"name": "tiers on fp16 keys ~N(0, 2000^2)",
                  "argv": ["tiers", "--spec", p["tiers-huge"], "--out", _out(p, "t-huge")],
                  "expect": ["seq0", "'keys'", "exponent range"]})
    return cases


def tampered_results_cases(p: dict[str, str]) -> list[Case]:
    """Family 7: the report must refuse results that do not match their summary."""
    def report(name: str, *expect: str) -> Case:
        return {"name": f"report on {name} results",
                "argv": ["report", p[name], "--out", _out(p, f"rep-{name}")],
                "expect": list(expect)}

    return [
        report("duplicated", "summary.json", "results_sha256"),
        report("duplicated-resigned", "replay.parquet", "result key"),
        report("appended", "summary.json", "results_sha256"),
        report("appended-resigned", "configs.json", "config_id"),
        report("wald-forged", "summary.json", "results_sha256"),
        report("nan-half", "summary.json", "results_sha256"),
        report("zero-rows", "replay.parquet", "0 rows"),
        report("missing-column", "replay.parquet", "'wald_cov'", "missing"),
        report("mistyped-column", "replay.parquet", "'err2'", "type string"),
        report("unsigned", "summary.json", "results_sha256", "--trust-unsigned"),
        report("rows", "summary.json", "n_rows"),
    ]


FAMILIES = {"5 output sets": output_set_cases, "6 silent numbers": silent_numbers_cases,
            "7 tampered results": tampered_results_cases}


def all_cases(p: dict[str, str]) -> list[Case]:
    """Every family's cases, each tagged with its family."""
    return [dict(c, family=fam) for fam, gen in FAMILIES.items() for c in gen(p)]


if __name__ == "__main__":  # pragma: no cover - run by tests/test_integrity.py
    doc = run_cases(json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(doc))
