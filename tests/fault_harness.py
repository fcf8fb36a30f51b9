"""The harness the hostile-input fault suites share: run generated ``tracesim`` cases in one
capped child process and judge each result the same way.

Every case must exit 2 with a one-line message naming the file and field and saying what was
expected, no traceback, within :data:`LIMIT_S` seconds of **CPU** time (a wall-clock guard of
:data:`HANG_GUARD_S` catches blocking hangs: CPU time does not depend on how loaded the
machine is, wall time does). The child runs single-threaded and sets its own data cap
(``RLIMIT_DATA`` counts thread stacks, whose pools grow with the core count, and a
``preexec_fn`` in a multi-threaded parent can deadlock); its peak memory is its own ``VmHWM``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MEMORY_CAP = 1 << 30
LIMIT_S = 10.0
HANG_GUARD_S = 120.0
ONE_THREAD = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                               "NUMBA_NUM_THREADS")}

__all__ = ["HANG_GUARD_S", "LIMIT_S", "MEMORY_CAP", "problems", "run_cases", "run_child",
           "snapshot"]


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every regular file under ``root`` (symlinks and FIFOs skipped)."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def run_child(module: str, root: Path, cases: list[dict]) -> tuple[dict[str, Any], float]:
    """Run ``python -m module CASES RESULTS`` capped and single-threaded; (its doc, wall s)."""
    (root / "cases.json").write_text(json.dumps(cases))
    boot = (f"import resource, runpy, sys; cap = {MEMORY_CAP}; "
            "resource.setrlimit(resource.RLIMIT_DATA, (cap, cap)); "
            f"sys.argv = [{module!r}] + sys.argv[1:]; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    env = dict(os.environ, PYTHONPATH=str(REPO), **ONE_THREAD)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", boot, str(root / "cases.json"),
                           str(root / "results.json")], env=env, cwd=str(REPO),
                          capture_output=True, text=True, timeout=1200)  # a hang guard only
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((root / "results.json").read_text()), wall


def problems(case: dict, result: dict) -> list[str]:
    """What is wrong with one case's result (empty: it is right)."""
    msg, bad = result["message"], []
    if result["code"] != 2:
        bad.append(f"exit {result['code']}")
    if "\n" in msg or not msg:
        bad.append("not one line")
    if "Traceback" in msg or "internal error" in msg:
        bad.append("traceback/internal error")
    bad += [f"{e!r} not named" for e in case["expect"] if e not in msg]
    if "expected" not in msg:
        bad.append("no expected value")
    if result["seconds"] > LIMIT_S:
        bad.append(f"{result['seconds']:.1f} s CPU")
    return bad


# --------------------------------------------------------------------------- child side


class _Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Hang()


def _vmhwm_kb() -> int:
    """Peak resident memory of this process (kB), from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return -1


def run_cases(cases: list[dict]) -> dict[str, Any]:
    """Run each case's ``tracesim`` command in this process: :data:`LIMIT_S` of CPU time and
    :data:`HANG_GUARD_S` of wall time at most; ``seconds`` is the CPU time it took."""
    from tracesim.app.cli import main as cli_main

    results = []
    for case in cases:
        err, out = io.StringIO(), io.StringIO()
        for sig in (signal.SIGALRM, signal.SIGPROF):
            signal.signal(sig, _alarm)
        signal.setitimer(signal.ITIMER_PROF, LIMIT_S)
        signal.setitimer(signal.ITIMER_REAL, HANG_GUARD_S)
        t0 = time.process_time()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                code: Any = cli_main(list(case["argv"]))
        except _Hang:
            code = "hang"
        except SystemExit as exc:  # argparse
            code = exc.code
        except BaseException as exc:  # MemoryError, RecursionError: a failure to report
            code = f"{type(exc).__name__}: {str(exc)[:200]}"
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
            signal.setitimer(signal.ITIMER_REAL, 0)
        # capture prints its user errors on stdout; every other command on stderr
        results.append({"name": case["name"], "code": code,
                        "message": err.getvalue().strip() or out.getvalue().strip(),
                        "seconds": time.process_time() - t0})
    return {"cases": results, "vmhwm_kb": _vmhwm_kb()}


# --------------------------------------------------------------------------- parent side


def run_suite(module: str, root: Path, build_inputs, all_cases) -> dict[str, Any]:
    """Build the inputs under ``root/in``, run every case in one capped child, snapshot the
    inputs before and after: what the suite's tests then judge."""
    paths = build_inputs(root / "in")
    cases = all_cases(paths)
    before = snapshot(root / "in")
    doc, wall = run_child(module, root, cases)
    return {"root": root, "paths": paths, "cases": cases, "doc": doc, "before": before,
            "after": snapshot(root / "in"), "wall": wall}


def check_family(run: dict[str, Any], family: str, min_cases: int, tag: str) -> None:
    """Every case of ``family`` is right (:func:`problems`); prints the family's figures."""
    by_name = {r["name"]: r for r in run["doc"]["cases"]}
    cases = [c for c in run["cases"] if c["family"] == family]
    assert len(cases) >= min_cases
    bad = []
    for case in cases:
        result = by_name[case["name"]]
        found = problems(case, result)
        if found:
            bad.append(f"{case['name']}: {', '.join(found)}: {result['message'][-300:]!r}")
    slowest = max(by_name[c["name"]]["seconds"] for c in cases)
    print(f"\n[{tag}] family {family}: {len(cases) - len(bad)}/{len(cases)} exit 2 naming the "
          f"file and field; slowest {slowest:.2f} s CPU (limit {LIMIT_S:.0f} s)")
    assert not bad, "\n".join(bad)


def check_memory_and_inputs(run: dict[str, Any], tag: str) -> list[str]:
    """The child's peak stayed under the cap and every earlier file is byte-identical; returns
    the files that are new under the inputs (for the suite to judge)."""
    kb = run["doc"]["vmhwm_kb"]
    print(f"\n[{tag}] {len(run['cases'])} cases in one child: peak RSS {kb / 1024:.0f} MiB "
          f"(cap {MEMORY_CAP >> 20} MiB), {run['wall']:.1f} s wall, load "
          f"{os.getloadavg()[0]:.1f}")
    assert 0 < kb * 1024 < MEMORY_CAP
    before, after = run["before"], run["after"]
    assert set(before) <= set(after), sorted(set(before) - set(after))
    changed = [k for k in before if before[k] != after[k]]
    assert not changed, changed
    return sorted(set(after) - set(before))
