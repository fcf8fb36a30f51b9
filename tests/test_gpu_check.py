"""``benchmarks/gpu_check.sh``: usage errors, and its CPU dry run of the same Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env)


def test_usage_errors_exit_2(tmp_path):
    assert _run("--bogus").returncode == 2
    assert _run("--dry", str(tmp_path / "a"), str(tmp_path / "b")).returncode == 2


@pytest.mark.capture
@pytest.mark.slow
def test_dry_run_exercises_capture_check_and_decode_steps(tmp_path):
    proc = _run("--dry", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    capture = json.loads((tmp_path / "capture.json").read_text())
    assert capture["dry"] and capture["valid"] and capture["ok"]
    assert capture["n_outputs"] > 0 and capture["rel_err_max"] < 1e-2  # fp32 compute, fp16 store
    steps = json.loads((tmp_path / "steps.json").read_text())
    assert set(steps["ms_per_step"]) == {
        "full cache", "top-k", "poisson + offset", "poisson + offset + one-pass certificate",
        "poisson + offset + two-pass certificate"}
    assert all(t > 0 for t in steps["ms_per_step"].values())
    assert "vs attention" in (tmp_path / "serving_certificate.txt").read_text()
