"""Fault suite: damaged stores and specs, kills, concurrent writers, a full disk.

Targets (printed; run with ``-s`` to see them):

- every mutated input exits 2 within 10 s of CPU time (under a 1 GB data cap for the
  subprocess sample) with a message naming the file and the expected value; none hangs (a
  generous wall-clock guard catches blocking reads) or silently returns different numbers;
- every kill-and-rerun gives results identical to an uninterrupted run, nothing earlier lost;
- the second of two concurrent writers is refused.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.fault_mutations import BASE_SPEC, spec_mutations, store_mutations
from tests.replay_fixtures import build_store
from tracesim.app.cli import main as cli_main
from tracesim.dataset_read import read_results

REPO = Path(__file__).resolve().parents[1]
ARGS = ["--layers", "0", "--seeds", "2", "--window", "8", "--score", "snapkv",
        "--design", "topk,poisson", "--budget", "0.4", "--no-progress"]
LIMIT_S = 10.0
#: Wall-clock guard against *blocking* hangs (a read of a FIFO burns no CPU); the target
#: itself is CPU time (LIMIT_S), which does not depend on how loaded the machine is.
HANG_GUARD_S = 120.0
MEMORY_CAP = 1 << 30
#: The capped children run single-threaded: RLIMIT_DATA also counts thread stacks, and the
#: BLAS/OpenMP/numba pools grow with the core count, so the cap would measure the machine.
ONE_THREAD = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                               "NUMBA_NUM_THREADS")}


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def _run_cli(argv: list[str], limit: float | None = LIMIT_S) -> tuple[int, str, float]:
    """In-process ``tracesim`` run: (exit code, stderr, CPU seconds of this process).

    ``limit`` seconds of process CPU time (every thread) stop it as a hang, and so does
    :data:`HANG_GUARD_S` of wall-clock time; ``limit=None`` (the fixture's first replay, which
    may compile numba's kernels on a fresh clone: a minute on a slow machine) keeps only the
    wall-clock guard, doubled.
    """
    err, out = io.StringIO(), io.StringIO()
    old = {sig: signal.signal(sig, _alarm) for sig in (signal.SIGALRM, signal.SIGPROF)}
    if limit is not None:
        signal.setitimer(signal.ITIMER_PROF, limit)
    signal.setitimer(signal.ITIMER_REAL, HANG_GUARD_S * (1 if limit is not None else 2))
    t0 = time.process_time()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = cli_main(argv)
    except _Hang:
        code = -1
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return code, err.getvalue(), time.process_time() - t0


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    store = build_store(root / "store", n_seqs=2, n_layers=1, n_heads=2, n_kv=1, d=8)
    ref = root / "ref"
    code, err, _ = _run_cli(["replay", str(store), *ARGS, "--out", str(ref)], limit=None)
    assert code == 0, err
    return root, store, read_results(ref)


def _snapshot(out: Path) -> dict[str, bytes]:
    """Every file of a replay's results dataset, by name (to compare byte for byte)."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted((out / "results").rglob("*"))
            if p.is_file()}


def _message_ok(msg: str, label: str) -> bool:
    return label in msg and "expected" in msg


def test_mutated_stores_exit_2_naming_file_and_field(base, tmp_path):
    root, store, reference = base
    mutations = store_mutations()
    assert len(mutations) >= 150
    bad, times = [], []
    for i, (name, label, apply) in enumerate(mutations):
        case = tmp_path / f"m{i}"
        shutil.copytree(store, case / "store")
        apply(case / "store")
        code, err, secs = _run_cli(["replay", str(case / "store"), *ARGS,
                                    "--out", str(case / "out")])
        times.append(secs)
        if code == 0:
            same = read_results(case / "out").equals(reference)
            bad.append(f"{name}: exit 0 ({'same' if same else 'DIFFERENT'} numbers)")
        elif code != 2 or not _message_ok(err, label):
            bad.append(f"{name}: exit {code}, message {err.strip()[-300:]!r}")
        shutil.rmtree(case, ignore_errors=True)
    print(f"\n[faults] {len(mutations)} mutated stores: {len(mutations) - len(bad)} exit 2 "
          f"naming the file; slowest {max(times):.2f} s CPU, median {np.median(times):.3f} s")
    assert not bad, "\n".join(bad)


def test_mutated_specs_exit_2_naming_the_key(base, tmp_path):
    root, store, _ = base
    bad, times = [], []
    cases = spec_mutations()
    for i, (name, key, doc) in enumerate(cases):
        spec = tmp_path / f"spec{i}.yaml"
        if isinstance(doc, bytes):
            spec.write_bytes(doc)
        else:
            doc = dict(doc, store=str(store) if doc["store"] == "store" else doc["store"])
            spec.write_text(yaml.safe_dump(doc))
        code, err, secs = _run_cli(["sweep", str(spec), "--dry-run", "--no-calibrate",
                                    "--out", str(tmp_path / f"o{i}")])
        times.append(secs)
        if code != 2 or spec.name not in err or key not in err:
            bad.append(f"{name}: exit {code}, message {err.strip()[-300:]!r}")
    print(f"\n[faults] {len(cases)} mutated specs: {len(cases) - len(bad)} exit 2 naming "
          f"the file and key; slowest {max(times):.2f} s CPU")
    assert not bad, "\n".join(bad)


#: ``tracesim`` under a data cap set by the child itself (no ``preexec_fn``: forking a
#: multi-threaded parent and running Python before exec can deadlock).
CAPPED = (f"import resource, sys; cap = {MEMORY_CAP}; "
          "resource.setrlimit(resource.RLIMIT_DATA, (cap, cap)); "
          "from tracesim.app.cli import main; sys.exit(main(sys.argv[1:]))")


def _capped(argv: list[str]) -> list[str]:
    return [sys.executable, "-c", CAPPED, *argv]


def test_subprocess_sample_under_memory_cap(base, tmp_path):
    """A sample of the worst inputs in real processes, 1 GB data cap, CPU time < 10 s."""
    root, store, _ = base
    by_name = {name: (label, apply) for name, label, apply in store_mutations()}
    sample = ["model.n_layers=1000000000", "model.json deep", "model.json as fifo",
              "o_proj as devzero", "seq as fifo", "seq flip 3"]
    env = dict(os.environ, PYTHONPATH=str(REPO), **ONE_THREAD)
    # This test's own children only: RUSAGE_CHILDREN also holds every child pytest reaped
    # before (captures, sweeps), so the figure is a difference.
    usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    procs = []
    for name in sample:
        case = tmp_path / name.replace(" ", "_")
        shutil.copytree(store, case / "store")
        by_name[name][1](case / "store")
        argv = _capped(["replay", str(case / "store"), *ARGS, "--out", str(case / "out")])
        procs.append((name, subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.PIPE, text=True)))
    spec = tmp_path / "huge.yaml"
    spec.write_text(yaml.safe_dump(dict(BASE_SPEC, store=str(store), seeds=10**9)))
    procs.append(("spec seeds 1e9", subprocess.Popen(
        _capped(["sweep", str(spec), "--dry-run", "--no-calibrate"]), env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)))
    bad = []
    for name, proc in procs:
        try:
            _, err = proc.communicate(timeout=300)  # a hang guard; CPU time is the target
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            bad.append(f"{name}: hung")
            continue
        if proc.returncode != 2 or "expected" not in err or "Traceback" in err:
            bad.append(f"{name}: exit {proc.returncode}: {err.strip()[-300:]}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (usage.ru_utime + usage.ru_stime - usage0.ru_utime - usage0.ru_stime) / len(procs)
    print(f"\n[faults] {len(procs)} subprocesses under a 1 GB cap: {len(procs) - len(bad)} "
          f"exit 2; mean CPU {cpu:.1f} s per process (incl. interpreter start), load "
          f"{os.getloadavg()[0]:.1f}")
    assert not bad, "\n".join(bad)
    assert cpu < LIMIT_S


# --------------------------------------------------------------------------- writes


def test_rejected_command_keeps_earlier_results(base, tmp_path):
    root, store, reference = base
    out = tmp_path / "r1"
    assert _run_cli(["replay", str(store), *ARGS, "--out", str(out)])[0] == 0
    before = _snapshot(out)
    code, err, _ = _run_cli(["replay", str(store), "--seeds", "0", "--out", str(out)])
    assert code == 2 and "--seeds" in err
    assert _snapshot(out) == before
    (tmp_path / "afile").write_text("x")
    for argv in (["--out", str(tmp_path / "afile")], ["--threads", "100000", "--out", str(out)],
                 ["--threads", "0", "--out", str(out)]):
        code, err, _ = _run_cli(["replay", str(store), *argv])
        assert code == 2 and "expected" in err and "Traceback" not in err


def test_disk_full_is_a_clean_error_and_loses_nothing(base, tmp_path, monkeypatch):
    root, store, reference = base
    out = tmp_path / "full"
    assert _run_cli(["replay", str(store), *ARGS, "--out", str(out)])[0] == 0
    before = _snapshot(out)
    import tracesim.atomic as atomic

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", no_space)
    code, err, _ = _run_cli(["replay", str(store), *ARGS, "--seeds", "3", "--out", str(out)])
    monkeypatch.undo()
    assert code == 2 and "disk full" in err and "Traceback" not in err
    assert _snapshot(out) == before
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))
    print("\n[faults] simulated ENOSPC: exit 2, earlier results intact, no temp file left")


def test_second_concurrent_writer_is_refused(base, tmp_path):
    from tracesim.atomic import DirLock

    root, store, _ = base
    out = tmp_path / "locked"
    out.mkdir()
    refused = 0
    with DirLock(out):
        code, err, _ = _run_cli(["replay", str(store), *ARGS, "--out", str(out)])
        refused += code == 2 and "another" in err
        spec = tmp_path / "s.yaml"
        spec.write_text(yaml.safe_dump(dict(BASE_SPEC, store=str(store))))
        code, err, _ = _run_cli(["sweep", str(spec), "--out", str(out), "--no-progress"])
        refused += code == 2 and "another" in err
    assert not (out / "results").exists()
    # two real processes: the second is refused while the first runs
    env = dict(os.environ, PYTHONPATH=str(REPO))
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from tracesim.atomic "
                               "import DirLock; l = DirLock(sys.argv[1]); print('held', "
                               "flush=True); time.sleep(600)", str(out)], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code, err, _ = _run_cli(["replay", str(store), *ARGS, "--out", str(out)])
        refused += code == 2 and "another" in err
    finally:
        holder.kill()
        holder.wait()
    assert _run_cli(["replay", str(store), *ARGS, "--out", str(out)])[0] == 0
    print(f"\n[faults] concurrent writers: {refused} of 3 second writers refused (exit 2)")
    assert refused == 3


def test_replay_sigkill_at_random_points_then_rerun(base, tmp_path):
    """Kill ``tracesim replay`` at seeded random times while it overwrites a good result;
    the earlier results survive byte for byte, and the rerun (resuming the parts written)
    equals an uninterrupted run."""
    root, store, _ = base
    big = build_store(tmp_path / "big", n_seqs=4, n_layers=2, n_heads=4, n_kv=2, d=16, P=400,
                      prompt_length=380)
    args = ["--seeds", "8", "--window", "8", "--score", "snapkv,h2o", "--design",
            "topk,poisson,bernoulli", "--budget", "0.2,0.4", "--no-progress"]
    ref = tmp_path / "ref"
    assert _run_cli(["replay", str(big), *args, "--out", str(ref)])[0] == 0
    want = read_results(ref)
    out = tmp_path / "out"
    assert _run_cli(["replay", str(big), *args, "--seeds", "2", "--out", str(out)])[0] == 0
    earlier = _snapshot(out)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    rng = np.random.default_rng(7)
    killed = 0
    for delay in rng.uniform(0.0, 0.5, size=2):
        proc = subprocess.Popen([sys.executable, "-m", "tracesim.app.cli", "replay", str(big),
                                 *args, "--out", str(out)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 240
        # wait until it is writing (its temp file exists), then a seeded random delay
        while not list(out.glob(".results.build/parts/*.tmp")) and proc.poll() is None:
            assert time.monotonic() < deadline, "replay never started writing"
            time.sleep(0.005)
        time.sleep(float(delay))
        killed += proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert _snapshot(out) == earlier or read_results(out).equals(want)
    assert _run_cli(["replay", str(big), *args, "--out", str(out)])[0] == 0
    assert read_results(out).equals(want)
    assert not list(out.glob(".*.tmp")) and not (out / ".results.build").exists()
    print(f"\n[faults] replay SIGKILL: {killed} kill(s) mid-run; earlier file intact, rerun "
          "identical to the uninterrupted run")


def test_skip_damaged_replays_the_rest_and_debug_shows_tracebacks(base, tmp_path):
    import json

    root, store, reference = base
    case = tmp_path / "store"
    shutil.copytree(store, case)
    data = bytearray((case / "seq" / "seq0.arrow").read_bytes())
    data[len(data) // 2] ^= 0x10
    (case / "seq" / "seq0.arrow").write_bytes(bytes(data))
    code, err, _ = _run_cli(["replay", str(case), *ARGS, "--out", str(tmp_path / "a")])
    assert code == 2 and "seq/seq0.arrow" in err and "checksum" in err
    code, err, _ = _run_cli(["replay", str(case), *ARGS, "--skip-damaged",
                             "--out", str(tmp_path / "b")])
    assert code == 0 and "seq/seq0.arrow" in err
    got = read_results(tmp_path / "b")
    assert set(got["sequence_id"].to_pylist()) == {"seq1"}
    want = reference.filter(reference["sequence_id"].to_numpy(zero_copy_only=False) == "seq1")
    assert got.equals(want)
    summary = json.loads((tmp_path / "b" / "results" / "summary.json").read_text())
    assert len(summary["skipped_damaged"]) == 1
    grid = tmp_path / "grid.yaml"
    grid.write_bytes(b"grid: \xff\n")
    argv = ["evict", str(case), "--grid", str(grid), "--out", str(tmp_path / "e")]
    code, err, _ = _run_cli(argv)
    assert code == 2 and "grid.yaml" in err and "UTF-8" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="UTF-8"):  # --debug lets the exception through
        cli_main(["--debug", *argv])
