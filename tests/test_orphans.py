"""No orphans: the sweep's local pool workers exit when their driver is killed with ``kill -9``
(issue #32, family 5).

A real driver process builds the pool exactly as the local backend does
(:func:`tracesim.sweep.backends.make_pool`), keeps one task running on every worker (one
sleeping, which leaves the GIL to the watching thread, one spinning in Python), prints the
workers' pids and waits. The test kills the driver with SIGKILL and polls until the workers are
gone, with a generous bound (the watch polls every 0.5 s; the bound only says "not 20 minutes").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tracesim.orphans import driver_alive, process_start

DRIVER = r"""
import json, os, sys, time
from tracesim.sweep.backends import make_pool

def main():
    pool = make_pool(2, 1, warm=False)
    futures = [pool.submit(time.sleep, 600), pool.submit(sum, range(10**12))]
    deadline = time.monotonic() + 120
    while len(pool._processes) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # both initializers have run (the tasks are in flight)
    print(json.dumps({"driver": os.getpid(), "workers": sorted(pool._processes)}), flush=True)
    time.sleep(600)

if __name__ == "__main__":
    main()
"""


def _gone(pid: int) -> bool:
    return process_start(pid) is None  # gone, or a zombie nobody reaped yet


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and prctl")
def test_workers_exit_when_the_driver_is_killed(tmp_path: Path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env,
                            text=True)
    workers: list[int] = []
    try:
        line = proc.stdout.readline()
        assert line, "the driver printed nothing"
        doc = json.loads(line)
        workers = doc["workers"]
        assert len(workers) == 2 and all(not _gone(w) for w in workers)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()  # reaped: the workers' parent is really gone
        deadline = time.monotonic() + 60  # generous: a loaded machine; not a speed claim
        while time.monotonic() < deadline and not all(_gone(w) for w in workers):
            time.sleep(0.2)
        alive = [w for w in workers if not _gone(w)]
        assert not alive, f"workers {alive} outlived their driver"
    finally:
        for w in workers:  # never leave a stray process behind a failed test
            if not _gone(w):
                os.kill(w, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_driver_alive_tells_a_reused_pid_from_the_driver():
    me = os.getpid()
    start = process_start(me)
    assert start is not None and driver_alive(me, start)
    assert not driver_alive(me, start + "0")  # same pid, another start time: not the driver
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not driver_alive(child.pid, None)
