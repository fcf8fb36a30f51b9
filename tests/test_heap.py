"""tracesim.heap: freed memory kept for reuse (glibc), switched off by the environment.

Each case runs in a fresh interpreter (the malloc thresholds are set once per process) that
counts its own minor page faults while it allocates, touches and frees arrays of growing size
(256 KiB to 4 MiB, twice; under the 4 MiB from which numpy asks for huge pages). Without the
thresholds raised glibc maps most of them on their own and unmaps them when freed, so they
arrive as fresh pages (about 16,900 faults of 31,680 pages here); with them raised the arrays
come from the heap and only its growth to the largest one faults (about 1,000).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import resource, sys
import numpy as np
sys.path.insert(0, {root!r})
from tracesim.heap import keep_freed_memory
ok = keep_freed_memory()
again = keep_freed_memory()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):
    for kib in range(256, 4096, 128):
        a = np.empty(kib << 7)  # kib KiB of float64
        a.fill(1.0)
        del a
print(ok, again, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(**env: str) -> tuple[bool, bool, int]:
    run = subprocess.run([sys.executable, "-c", _CHILD.format(root=str(ROOT))],
                         env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    ok, again, faults = run.stdout.split()
    return ok == "True", again == "True", int(faults)


def _glibc() -> bool:
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (AttributeError, ValueError, OSError):
        return False


def test_freed_memory_is_reused_on_glibc_and_left_alone_elsewhere():
    ok, again, faults = _run(TRACESIM_KEEP_FREED_MEMORY="1")
    assert ok == again == _glibc()
    if ok:
        # 124 MiB touched in all (31,680 pages): only the heap's growth to the largest array
        # (3.9 MiB, 992 pages) should fault, plus a little of the interpreter's own
        assert faults < 4_000, faults


def test_the_environment_switches_it_off():
    ok, again, _ = _run(TRACESIM_KEEP_FREED_MEMORY="0")
    assert not ok and not again
