"""Run every benchmark once, one after the other (``make bench``).

Each benchmark measures its ratios side by side within its own run; running them one at a time
keeps them from competing for the cores. Pass ``--only NAME[,NAME]`` to pick some.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: name -> extra arguments (defaults sized for a 2-core machine, a few minutes each).
BENCHMARKS: dict[str, list[str]] = {
    "capture": ["--repeats", "2"],
    "replay": [],
    "rerun": [],
    "memory": [],
    "sweep": [],
    "evict": ["--repeats", "2"],
    "tiers": [],
    "serving_certificate": ["--threads", "1", "--rounds", "9", "--calls", "3"],
    "fetch": ["--rounds", "5"],
    "cli": [],
    "perstep": ["--rounds", "5"],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None,
                    help="comma-separated subset of " + ",".join(BENCHMARKS))
    args = ap.parse_args(argv)
    names = list(BENCHMARKS) if args.only is None else args.only.split(",")
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; expected some of {list(BENCHMARKS)}")
    failed = []
    for name in names:
        print(f"\n######## bench_{name} ########", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, str(HERE / f"bench_{name}.py"), *BENCHMARKS[name]])
        print(f"(bench_{name}: exit {rc}, {time.perf_counter() - t0:.0f} s)", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
