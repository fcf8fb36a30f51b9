"""Command-line start-up: ``tracesim --help``, ``import tracesim`` and a one-layer replay.

Beside them, ``benchmarks/numba_floor.py``: importing numba and calling one tiny function from
its on-disk cache, the least any command that runs a numba kernel costs.

Each command runs in a fresh interpreter (as a user types it), measured wall-clock from process
start to exit. The commands alternate (A, B, C, then again) for ``--rounds`` rounds; the report
gives the median per command with ``os.getloadavg()`` printed beside every round. Numba's
on-disk kernel cache is warmed by one untimed run of each command first, as on any machine
after the first replay.

The one-layer replay reads a synthetic 1k store (``tracesim synth --positions 1024 --layers 1``)
with the replay defaults (SnapKV, top-k and Poisson, 25% budget, 32 seeds, output-space
certificate on).

Usage: ``python benchmarks/bench_cli.py [--rounds 5] [--positions 1024]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.protocol import load_average  # noqa: E402


def _run(cmd: list[str]) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--positions", type=int, default=1024)
    args = ap.parse_args(argv)
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        store, out = Path(tmp) / "store", Path(tmp) / "out"
        subprocess.run([py, "-m", "tracesim.app.cli", "synth", "--positions", str(args.positions),
                        "--layers", "1", "--quiet", "--out", str(store)], check=True, cwd=ROOT)
        commands = {
            "tracesim --help": [py, "-m", "tracesim.app.cli", "--help"],
            "python -c 'import tracesim'": [py, "-c", "import tracesim"],
            "numba floor: import numba, one cached njit call": [
                py, str(ROOT / "benchmarks" / "numba_floor.py")],
            f"one-layer replay, {args.positions} positions, defaults": [
                py, "-m", "tracesim.app.cli", "replay", str(store), "--no-progress", "--out",
                str(out)],
        }
        for cmd in commands.values():  # warm the kernel cache and the file cache
            _run(cmd)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for r in range(args.rounds):
            for name, cmd in commands.items():
                times[name].append(_run(cmd))
            load = load_average()
            print(f"round {r + 1}: " + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items())
                  + f"; load average {load}", flush=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"\n| command | median of {args.rounds} (s) |\n|---|---|")
    for name, t in medians.items():
        print(f"| {name} | {t:.2f} |")
    print(f"load average at the end: {load_average()}")
    return medians


if __name__ == "__main__":
    main()
