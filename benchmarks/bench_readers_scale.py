"""Every results reader at scale: rows/s and peak memory of each one's process tree on 10^6,
10^7, ... rows built from a real sweep.

The scaled datasets are :mod:`bench_report_scale`'s (a real sweep's results dataset replicated
with renamed sequences, manifest and summary re-recorded, so every reader verifies it as it
verifies a sweep's). On each size every reader with a command line runs in a child process:

- ``report``: ``tracesim report D --out R``
- ``report-dask``: the same with ``--scheduler processes`` (only with ``--dask``)
- ``frontier``: ``tracesim frontier D --out F``
- ``export``: ``tracesim export D --format parquet-dataset --out E``
- ``perstep``: ``python -m tracesim.analysis.perstep D [--by COLUMN]`` (the per-step table
  and its costs; ``--perstep-by allocator`` on the example sweep, whose top-k baselines
  differ by allocator)

``analysis.evict_perstep`` reads in-loop outcome tables (one row per sequence, configuration
and seed), not results, and the validity rule has no command of its own (``frontier`` fits
it; ``report``'s C8 applies it): neither has a results input to scale.

Peak memory is the sum over the process tree of each process's ``VmHWM`` (``/proc``, polled
every 0.2 s, the last value kept per process), an upper bound of the tree's simultaneous peak.
The load average is printed with each line, and each reader's CPU seconds (its finished
process tree's user + system time): wall times taken on a loaded machine are not speed
results; CPU times are guidance, memory peaks are results.

Usage::

    tracesim sweep data/sweeps/example.yaml --out SWEEP          # a real sweep (~550k rows)
    python benchmarks/bench_readers_scale.py SWEEP --rows 1e6 1e7 [--readers report frontier]
        [--work DIR] [--dask] [--cap-mb MB] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_report_scale import run_tree, scale  # noqa: E402

READERS = ("report", "report-dask", "frontier", "export", "perstep")


def reader_command(reader: str, results: Path, out: Path,
                   perstep_by: str | None = None) -> list[str]:
    """The command line that runs ``reader`` on ``results``, writing under ``out``."""
    cli = [sys.executable, "-m", "tracesim.app.cli"]
    if reader == "report":
        return [*cli, "report", str(results), "--out", str(out)]
    if reader == "report-dask":
        return [*cli, "report", str(results), "--out", str(out), "--scheduler", "processes"]
    if reader == "frontier":
        return [*cli, "frontier", str(results), "--out", str(out)]
    if reader == "export":
        return [*cli, "export", str(results), "--format", "parquet-dataset", "--out", str(out)]
    if reader == "perstep":
        return [sys.executable, "-m", "tracesim.analysis.perstep", str(results),
                *(["--by", perstep_by] if perstep_by else [])]
    raise ValueError(f"reader {reader!r}: expected one of {READERS}")


def _children_cpu() -> float:
    """User + system CPU seconds of this process's finished children (and theirs, when
    waited for): a reader's CPU time on a loaded machine, where its wall time is not."""
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", type=Path, help="a tracesim sweep output (results dataset)")
    ap.add_argument("--rows", type=float, nargs="+", default=[1e6])
    ap.add_argument("--readers", nargs="+", default=[r for r in READERS if r != "report-dask"],
                    choices=READERS)
    ap.add_argument("--dask", action="store_true", help="also run report-dask")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory")
    ap.add_argument("--perstep-by", default=None, metavar="COLUMN",
                    help="perstep's --by (the example sweep needs allocator: its top-k "
                    "baselines differ by allocator)")
    ap.add_argument("--cap-mb", type=float, default=None,
                    help="kill a reader whose process tree holds more than this resident memory "
                    "(MB) and report it as killed at the cap (for earlier versions that load "
                    "the whole table)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    readers = list(args.readers) + (["report-dask"] if args.dask
                                    and "report-dask" not in args.readers else [])
    base = json.loads((args.sweep / "results" / "manifest.json").read_text())["n_rows"]
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-readers-"))
    work.mkdir(parents=True, exist_ok=True)
    out_rows = []
    for target in args.rows:
        copies = max(1, math.ceil(target / base))
        d = work / f"scaled-{copies}"
        if d.exists():
            shutil.rmtree(d)
        rows = scale(args.sweep, d, copies)
        for reader in readers:
            out = work / f"{reader}-{copies}"
            shutil.rmtree(out, ignore_errors=True)
            load = os.getloadavg()[0]
            cpu = _children_cpu()
            res = run_tree(reader_command(reader, d, out, args.perstep_by),
                           work / f"{reader}-{copies}.stderr", args.cap_mb)
            res.update(reader=reader, rows=rows, load_avg_1m=round(load, 2),
                       cpu_s=round(_children_cpu() - cpu, 1),
                       rows_per_s=round(rows / res["seconds"]) if res["rc"] == 0 else None)
            out_rows.append(res)
            print(f"{reader:<12} {rows:>12,} rows  rc={res['rc']}  {res['seconds']:8.1f} s  "
                  f"{res['rows_per_s'] or 0:>10,} rows/s  CPU {res['cpu_s']:8.1f} s  "
                  f"peak {res['peak_mb']:8.1f} MB "
                  f"({res['processes']} process(es))  load {load:.2f} {res['stderr_tail']}",
                  flush=True)
            shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(d, ignore_errors=True)
    if args.json:
        print(json.dumps(out_rows, indent=1))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
