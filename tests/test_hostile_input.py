"""Hostile and careless input: no hang, no out-of-memory, no lost results.

One generator per family lives in ``tests/hostile_cases.py``. Every case runs the real
``tracesim`` command line in one child process (one interpreter start for all of them) under a
1 GiB data cap (``tests/fault_harness.py``), and must exit 2 within 10 s of CPU time with a
one-line message naming the file and the field, no traceback; the child's peak resident memory
(VmHWM) stays under the cap, and every file that existed before (store, results, an earlier
export, the specs) is byte-identical afterwards. The bounded reader, the count bounds and the
output guard are also checked in-process, with a tracemalloc peak bound.
"""

from __future__ import annotations

import json
import os
import time
import tracemalloc
from pathlib import Path

import pytest

from tests.fault_harness import LIMIT_S, check_family, check_memory_and_inputs, run_suite
from tests.hostile_cases import FAMILIES, all_cases, build_inputs, laughs
from tracesim.errors import UsageError


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """Inputs, every case, and the child's results (run once for the module)."""
    return run_suite("tests.hostile_cases",
                     tmp_path_factory.mktemp("hostile"),
                     build_inputs, all_cases)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_exits_2_naming_file_and_field(hostile, family):
    check_family(hostile, family, 7, "hostile")


def test_peak_memory_and_earlier_outputs(hostile):
    new = check_memory_and_inputs(hostile, "hostile")
    root = Path(hostile["paths"]["root"])
    # nothing new inside an input; a refused command may at most leave its own outs/ entry
    assert all(k.startswith("outs/") for k in new), new
    for name in ("store", "results", "export"):
        assert (root / name).is_dir()


# --------------------------------------------------------------------------- in-process


def _refused(fn, *args, match: tuple[str, ...], **kwargs) -> float:
    """Call ``fn``; it must raise a ValueError naming ``match``; return the traced peak (MiB)."""
    tracemalloc.start()
    t0 = time.process_time()
    try:
        with pytest.raises(ValueError) as info:
            fn(*args, **kwargs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.process_time() - t0 < LIMIT_S  # CPU time: the same on a loaded machine
    msg = str(info.value)
    assert "\n" not in msg and all(m in msg for m in match), msg
    return peak / 2**20


def test_reader_refuses_bombs_within_bounded_memory(tmp_path):
    from tracesim import safeio

    docs = {
        "laughs.yaml": (f"name: {laughs()}\n", ("name", "alias")),
        "dup.yaml": ("seeds: 2\nname: x\nseeds: 100000\n", ("'seeds'", "line 3", "line 1")),
        "deep.yaml": ("grid: " + "[" * 5000 + "]" * 5000 + "\n", ("grid", "nesting")),
        "blocks.yaml": ("".join("  " * i + f"k{i}:\n" for i in range(300)) + "  " * 300
                        + "v: 1\n", ("k0.k1", "nesting")),
    }
    peaks = []
    for name, (text, match) in docs.items():
        (tmp_path / name).write_text(text)
        peaks.append(_refused(safeio.read_yaml, tmp_path / name, match=(name, *match)))
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    peaks.append(_refused(safeio.read_json, tmp_path / "deep.json", match=("nesting",)))
    (tmp_path / "dup.json").write_text('{"a": {"scaling": 1, "scaling": 2}}')
    peaks.append(_refused(safeio.read_json, tmp_path / "dup.json", match=("'scaling'", "twice")))
    print(f"\n[hostile] reader: traced peak {max(peaks):.1f} MiB over {len(peaks)} bombs")
    assert max(peaks) < 64
    # brackets inside JSON strings do not count; a plain document parses
    (tmp_path / "ok.json").write_text(json.dumps({"a": "[[[[" * 20, "b": [1, {"c": None}]}))
    assert safeio.read_json(tmp_path / "ok.json")["b"] == [1, {"c": None}]
    assert safeio.loads_yaml("a: {b: [1, 2]}\nc: x\n", "x.yaml") == {"a": {"b": [1, 2]},
                                                                    "c": "x"}


@pytest.mark.parametrize("loader", ["BoundedLoader", "PyBoundedLoader"])
def test_yaml_refusals_same_with_and_without_libyaml(loader):
    """Where libyaml is missing the pure-Python loader runs: the same refusals, same words."""
    from tracesim import safeio

    cls = getattr(safeio, loader)
    cases = {f"name: {laughs()}\n": "x.yaml: name[1][0]: line 1: YAML alias *l0",
             "a: 1\nb: {c: [1, *q]}\n": "x.yaml: b.c[1]: line 2: YAML alias *q",
             "grid: " + "[" * 5000 + "]" * 5000 + "\n": "x.yaml: grid",
             "a: 1\na: 2\n": "x.yaml: line 2: key 'a' appears twice (first on line 1)",
             "a: [1\n": "x.yaml: not valid YAML"}
    for text, start in cases.items():
        with pytest.raises(UsageError) as info:
            safeio.loads_yaml(text, "x.yaml", loader_class=cls)
        msg = str(info.value)
        assert msg.startswith(start) and "\n" not in msg and "expected" in msg, msg
    doc = "a: {b: [1, 2.5, {c: d}]}\n? [k]\n: 1\ne: !!binary aGk=\n"
    with pytest.raises(UsageError, match="unhashable"):
        safeio.loads_yaml(doc, "x.yaml", loader_class=cls)
    ok = "a: {b: [1, 2.5, {c: d}]}\ne: !!binary aGk=\n<<: {f: 1}\n"
    assert safeio.loads_yaml(ok, "x.yaml", loader_class=cls) == {
        "a": {"b": [1, 2.5, {"c": "d"}]}, "e": b"hi", "f": 1}


def test_reader_refuses_special_files(tmp_path):
    from tracesim import safeio

    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    (tmp_path / "big").write_bytes(b"x" * 2048)
    for path, word in (("/dev/zero", "device"), (tmp_path / "fifo", "FIFO"),
                       (tmp_path, "directory"), ("/proc/self/status", "/proc"),
                       (tmp_path / "loop", "symlink loop")):
        _refused(safeio.read_bytes, path, 1 << 20, "spec", match=(str(path), word))
        _refused(safeio.hash_file, path, match=(str(path), word))
    _refused(safeio.read_bytes, tmp_path / "big", 1024, match=("2048 bytes", "1024"))
    _refused(safeio.hash_file, tmp_path / "big", 1024, match=("1024",))
    assert safeio.read_bytes(tmp_path / "big", 2048) == b"x" * 2048
    with pytest.raises(FileNotFoundError):
        safeio.read_text(tmp_path / "missing", 10)


def test_grid_list_shares_one_configuration_budget():
    from tracesim.policies.grid import SpecError, expand_grid

    one = {"score": ["snapkv", "h2o"], "design": ["topk", "poisson"],
           "budget": [0.1, 0.2, 0.3, 0.4, 0.5]}
    # 200k references to one mapping (what a YAML alias list would build): refused at the
    # copy that goes over the budget, not after expanding 2e9 configurations
    with pytest.raises(SpecError, match=r"grid: lists 200000 grid mappings"):
        expand_grid([one] * 200_000, "grid")
    peak = _refused(expand_grid, [one] * 1000, "grid", match=("grid[", "10000"))
    assert peak < 256
    assert len(expand_grid([one, one], "grid").policies) == 20


def test_counts_one_bound_every_spelling():
    from tracesim.counts import LAYERS, SEEDS, TIERS_SEEDS, parse_int

    assert SEEDS.check(100_000, "seeds") == 100_000
    for value in (0, 100_001, True, 2.0, "3", 10**30):
        with pytest.raises(UsageError, match="seeds"):
            SEEDS.check(value, "seeds")
    with pytest.raises(UsageError, match="lists 4097 seeds, expected at most 4096"):
        TIERS_SEEDS.check_items(list(range(4097)), "seeds")
    with pytest.raises(UsageError, match=r"layers: 1 repeats \(at \[1\] and \[2\]\)"):
        LAYERS.check_items([0, 1, 1], "layers")
    assert parse_int("1e3", "--n", SEEDS) == 1000
    for text in ("1e30", "9" * 5000, "nan", "inf", "x"):
        with pytest.raises(UsageError, match="--n"):
            parse_int(text, "--n", SEEDS)


def test_output_guard(tmp_path):
    from tracesim.outpaths import check_output, check_replaceable, mark_output

    store = tmp_path / "store"
    (store / "seq").mkdir(parents=True)
    spec = tmp_path / "specs" / "s.yaml"
    spec.parent.mkdir()
    spec.write_text("x: 1\n")
    os.symlink(store, tmp_path / "link")
    inputs = [("trace store", store), ("sweep spec", spec)]
    for out, word in (("", "empty"), (store, "is the trace store"),
                      (tmp_path / "link", "is the trace store"),
                      (store / "seq" / "out", "lies inside"), (tmp_path, "contains"),
                      (spec.parent, "contains the sweep spec")):
        with pytest.raises(UsageError, match=word):
            check_output(out, inputs)
    assert check_output(tmp_path / "out", inputs) == tmp_path / "out"
    assert check_output(spec.parent / "out", inputs) == spec.parent / "out"  # beside a spec
    with pytest.raises(UsageError, match="--overwrite replaces only"):
        check_replaceable(store, "export")
    (tmp_path / "mine").mkdir()
    mark_output(tmp_path / "mine", "export")
    check_replaceable(tmp_path / "mine", "export")
    with pytest.raises(UsageError, match="replay"):
        check_replaceable(tmp_path / "mine", "replay")
