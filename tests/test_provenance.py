"""File hashes, the pre-registration record, source digests and safe file names.

The file names are pinned literally: stores, sweep task files and in-loop parts written before
the shared helper must keep their names (a store's manifest names its files; a sweep or an
``evict`` run resumes by finding its earlier files).
"""

from __future__ import annotations

import hashlib
import os

import pytest
from tracesim.capture.inloop.evict_run import _safe_name as evict_part_name

from tracesim.digests import (
    PREREG_FILE,
    find_prereg,
    prereg_record,
    prereg_sha256,
    safe_file_stem,
    sha256_file,
    source_digest,
)
from tracesim.errors import UsageError
from tracesim.store.format import StoreError
from tracesim.store.format import safe_file_stem as store_stem
from tracesim.sweep.tasks import _safe as sweep_task_dir

#: id -> (store file stem, sweep task directory, evict parts file).
NAMES = {
    "seq-0": ("seq-0", "seq-0", "seq-0-f10a9c0dda45.parquet"),
    "a b/c": ("a_b_c-539138d51839", "a_b_c-539138d5", "a_b_c-539138d51839.parquet"),
    ".hidden": ("_hidden-1692419006a8", "hidden-16924190", ".hidden-1692419006a8.parquet"),
    "..": ("_.-5ec1f7e700f3", "_-5ec1f7e7", "..-5ec1f7e700f3.parquet"),
    "...": ("_..-ab5df625bc76", "_-ab5df625", "...-ab5df625bc76.parquet"),
    "": ("", "_-e3b0c442", "-e3b0c44298fc.parquet"),
    "x" * 120: ("x" * 100 + "-13f05a0b5947", "x" * 80 + "-13f05a0b",
                "x" * 80 + "-13f05a0b5947.parquet"),
    "é٣_ok": ("___ok-085eb06a9713", "___ok-085eb06a", "é٣_ok-085eb06a9713.parquet"),
    "niah.4k.001": ("niah.4k.001", "niah.4k.001", "niah.4k.001-d9da43a59ae5.parquet"),
    "_a": ("_a", "_a", "_a-34fb716034ed.parquet"),
    "-": ("-", "-", "--3973e022e932.parquet"),
}


@pytest.mark.parametrize("name", list(NAMES))
def test_file_names_are_those_of_earlier_stores_sweeps_and_runs(name):
    assert (store_stem(name), sweep_task_dir(name), evict_part_name(name)) == NAMES[name]


def test_a_safe_name_maps_to_itself_and_two_unsafe_names_do_not_collide():
    assert safe_file_stem("layer_3.part", max_chars=80, digest_chars=8) == "layer_3.part"
    a = safe_file_stem("a/b", max_chars=80, digest_chars=8)
    b = safe_file_stem("a:b", max_chars=80, digest_chars=8)
    assert a != b and a.startswith("a_b-") and b.startswith("a_b-")


def test_hashes_are_sha256_of_the_bytes(tmp_path):
    f = tmp_path / "prereg.yaml"
    f.write_bytes(b"alpha: 0.05\n")
    expected = "sha256:" + hashlib.sha256(b"alpha: 0.05\n").hexdigest()
    assert sha256_file(f) == expected
    assert prereg_sha256(f) == expected


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_is_refused_with_the_callers_error(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(StoreError, match="store file"):
        sha256_file(fifo, "store file", error=StoreError)
    with pytest.raises(UsageError, match="pre-registration file"):
        prereg_sha256(fifo)


def test_the_prereg_is_found_next_to_the_input_or_its_parents(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "repo" / "traces" / "store"
    store.mkdir(parents=True)
    assert find_prereg(None, str(store)) is None
    assert prereg_record(None, str(store)) is None
    prereg = tmp_path / "repo" / PREREG_FILE
    prereg.parent.mkdir()
    prereg.write_text("claims: {}\n")
    assert find_prereg(None, str(store)) == prereg.resolve()
    assert prereg_record(None, str(store)) == {"path": str(prereg.resolve()),
                                               "sha256": prereg_sha256(prereg)}
    explicit = tmp_path / "other.yaml"
    assert find_prereg(explicit, str(store)) == explicit
    assert find_prereg(None, "<dict>") is None  # a spec given as a dict: only the cwd


def test_the_source_digest_covers_paths_and_bytes(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    files = sorted(tmp_path.glob("*.py"))
    h = hashlib.sha256(b"a.py\0x = 1\n\0b.py\0y = 2\n\0")
    assert source_digest(tmp_path, files) == h.hexdigest()
    (tmp_path / "b.py").rename(tmp_path / "c.py")
    assert source_digest(tmp_path, sorted(tmp_path.glob("*.py"))) != h.hexdigest()


def test_seeds_of_outcomes_whose_seed_column_is_all_null_are_not_an_error():
    import pandas as pd
    from tracesim.analysis.provenance import _seeds

    df = pd.DataFrame({"seed": [None, None]}, dtype="float64")
    assert _seeds(None, df, "seed") is None
    assert _seeds(None, pd.DataFrame({"seed": [None, 3.0]}), "seed") == "3"
