"""Running sweeps: identical results on every backend, exactly-once resume after kills."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import pyarrow.parquet as pq
import pytest
import yaml

from tests.sweep_fixtures import SPEC_TEXT, build_sweep_store
from tracesim.digests import sha256_file
from tracesim.replay import replay
from tracesim.store import open_store
from tracesim.sweep import load_spec, plan_tasks, run_sweep, worker
from tracesim.sweep.worker import execute_task, write_configs

KEYS = ["store", "sequence_id", "layer", "config_id", "head", "query_index", "seed"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweeprun")
    build_sweep_store(root / "store")
    (root / "prereg.yaml").write_text("version: 1\n")
    doc = yaml.safe_load(SPEC_TEXT)
    doc["prereg"] = "prereg.yaml"
    (root / "spec.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return root


def results(out: Path) -> pd.DataFrame:
    # the parts directory as any Parquet reader sees it (parts are named in row order)
    df = pq.read_table(out / "results" / "parts").to_pandas()
    assert not df.duplicated(KEYS).any()
    return df.sort_values(KEYS).reset_index(drop=True)


@pytest.fixture(scope="module")
def reference(env):
    summary = run_sweep(env / "spec.yaml", workers=1, out=env / "ref", progress=False)
    assert summary.complete and summary.tasks["done"] == 9 and summary.workers == 1
    return results(env / "ref")


def test_summary_and_equivalence_with_in_process_replay(env, reference):
    summary = json.loads((env / "ref" / "results" / "summary.json").read_text())
    spec = load_spec(env / "spec.yaml")
    assert summary["spec_hash"] == spec.result_hash()
    assert summary["tasks"] == {"total": 9, "done": 9, "skipped": 0, "failed": 0,
                                "retries": 0}
    assert summary["n_rows"] == len(reference) and summary["seeds"] == [0, 1, 2]
    assert summary["prereg"]["sha256"] == sha256_file(env / "prereg.yaml")
    assert summary["version"] and summary["wall_time_s"] > 0
    # The sweep's rows are exactly what tracesim.replay computes in one process.
    direct = replay(open_store(env / "store"), list(spec.policies), seeds=3,
                    progress=False).to_pandas()
    direct.insert(0, "model_id", "synthetic-sweep")
    direct.insert(0, "store", "store")
    direct = direct.sort_values(KEYS).reset_index(drop=True)
    pd.testing.assert_frame_equal(reference, direct, check_exact=True)
    # A rerun finds everything finished and reuses the published results.
    again = run_sweep(env / "spec.yaml", out=env / "ref", progress=False)
    assert again.tasks["skipped"] == 9 and again.tasks["done"] == 0
    pd.testing.assert_frame_equal(results(env / "ref"), reference, check_exact=True)
    # Both summaries record the results file (rows, sha256, configurations) and the report's
    # loader accepts what the sweep wrote.
    from tracesim.analysis.report import load_results

    ids = sorted(p.id for p in spec.policies)
    for doc in (summary, json.loads((env / "ref" / "results" / "summary.json").read_text())):
        assert doc["results_file"] == "manifest.json" and doc["config_ids"] == ids
        assert doc["results_sha256"] == sha256_file(env / "ref" / "results" / "manifest.json")
    df, _ = load_results(env / "ref")
    assert len(df) == len(reference)


@pytest.mark.parametrize("backend", ["local", "dask"])
def test_two_workers_bit_identical(env, reference, backend):
    out = env / f"two-{backend}"
    summary = run_sweep(env / "spec.yaml", backend=backend, workers=2, threads_per_worker=1,
                        out=out, progress=False)
    assert summary.complete and summary.workers == 2 and summary.backend == backend
    pd.testing.assert_frame_equal(results(out), reference, check_exact=True)


def _cli(spec: Path, out: Path, workers: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tracesim.app.cli", "sweep", str(spec), "--out", str(out),
           "--workers", str(workers), "--threads-per-worker", "1", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_task_file(out: Path, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if list((out / "tasks").rglob("[!.]*.parquet")) if (out / "tasks").is_dir() else []:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    pytest.fail("no task file appeared")


def test_sigkill_whole_sweep_then_resume_exactly_once(env, reference):
    out = env / "killed"
    proc = _cli(env / "spec.yaml", out, workers=1)
    _wait_for_task_file(out, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    finished = [p for p in (out / "tasks").rglob("*.parquet") if not p.name.startswith(".")]
    assert 1 <= len(finished) < 9
    assert not (out / "results" / "manifest.json").exists()
    # A partial file under a final name, and a foreign file, must not reach the results.
    plan = plan_tasks(load_spec(env / "spec.yaml", output=out))
    pending = [t for t in plan.tasks if not (out / t.path).exists()]
    (out / pending[0].path).parent.mkdir(parents=True, exist_ok=True)
    (out / pending[0].path).write_bytes(b"PAR1 truncated")
    shutil.copy(finished[0], out / "tasks" / "store" / "stray.parquet")
    summary = run_sweep(env / "spec.yaml", out=out, workers=2, progress=False)
    assert summary.complete
    assert summary.tasks["skipped"] == len(finished)
    assert summary.tasks["done"] == 9 - len(finished)
    pd.testing.assert_frame_equal(results(out), reference, check_exact=True)
    assert not list(out.rglob(".*.tmp"))


def test_killed_worker_is_retried(env, reference):
    out = env / "worker-killed"
    proc = _cli(env / "spec.yaml", out, workers=2)
    _wait_for_task_file(out, proc)
    driver = psutil.Process(proc.pid)
    servers = [c for c in driver.children() if "forkserver" in " ".join(c.cmdline())]
    workers = (servers[0].children() if servers else
               [c for c in driver.children() if "spawn_main" in " ".join(c.cmdline())])
    assert workers, [c.cmdline() for c in driver.children()]
    workers[0].send_signal(signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr
    summary = json.loads((out / "results" / "summary.json").read_text())
    assert summary["complete"] and summary["tasks"]["retries"] >= 1, summary
    assert summary["tasks"]["done"] + summary["tasks"]["skipped"] == 9
    pd.testing.assert_frame_equal(results(out), reference, check_exact=True)


def test_failing_task_is_reported_then_resumed(env, reference, tmp_path):
    shutil.copytree(env / "store", tmp_path / "store")
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(SPEC_TEXT)
    seq_file = tmp_path / "store" / "seq" / "s1.arrow"
    good = seq_file.read_bytes()
    seq_file.write_bytes(b"\0" * len(good))
    summary = run_sweep(spec_path, workers=1, retries=1, progress=False)
    assert not summary.complete and summary.results is None
    assert summary.tasks["failed"] == 3 and summary.tasks["retries"] == 3
    assert summary.tasks["done"] == 6
    assert all("/s1/" in f["task"] for f in summary.failures)
    assert not (tmp_path / "out" / "results" / "manifest.json").exists()
    assert not (tmp_path / "out" / "results" / "parts").exists()
    saved = json.loads((tmp_path / "out" / "results" / "summary.json").read_text())
    assert saved["complete"] is False and len(saved["failures"]) == 3
    seq_file.write_bytes(good)
    summary = run_sweep(spec_path, workers=1, progress=False)
    assert summary.complete and summary.tasks["skipped"] == 6 and summary.tasks["done"] == 3
    pd.testing.assert_frame_equal(results(tmp_path / "out"), reference, check_exact=True)


def test_execute_task_per_seed_in_process(env, tmp_path):
    doc = yaml.safe_load(SPEC_TEXT)
    doc.update(record="per_seed", store=str(env / "store"), output=str(tmp_path / "ps"),
               sequences={"ids": ["s2"]}, layers=[1])
    spec_path = tmp_path / "ps.yaml"
    spec_path.write_text(yaml.safe_dump(doc))
    spec = load_spec(spec_path)
    plan = plan_tasks(spec)
    (task,) = plan.tasks
    write_configs(spec.output, plan, spec)
    info = execute_task(task, str(spec.output), plan.spec_hash, 1)
    table = pq.read_table(spec.output / task.path)
    assert info["rows"] == task.rows == table.num_rows
    df = table.to_pandas()
    assert (df["n_seeds"] == 1).all()
    assert set(df.loc[df["design"] == "poisson", "seed"]) == {0, 1, 2}
    det = (df["design"] == "topk") & (df["score"] != "random")
    assert df.loc[det, "seed"].isna().all()  # not applicable: a Parquet null
    assert np.isfinite(df["err2"]).all()
    with pytest.raises(RuntimeError, match="belongs to spec"):
        execute_task(task, str(spec.output), "0" * 64, 1)
    # A worker whose tracesim source differs from the driver's refuses to run.
    cfg = spec.output / "configs.json"
    doc = json.loads(cfg.read_text())
    doc["code"] = "f" * 64
    cfg.write_text(json.dumps(doc))
    worker._CONFIGS.clear()
    with pytest.raises(RuntimeError, match="different tracesim source code"):
        execute_task(task, str(spec.output), plan.spec_hash, 1)
    worker._CONFIGS.clear()
