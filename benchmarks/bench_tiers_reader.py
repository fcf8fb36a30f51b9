"""``tracesim report --tiers``' reader at scale: CPU seconds and peak memory (``VmHWM``) of
the whole-file read (``pq.read_table`` + :func:`scheduler_curves`, the previous reader) and of
the DuckDB aggregation (:func:`read_scheduler_curves`), each in a fresh child process, on a
synthetic ``tiers.parquet`` of N rows (tiers.parquet's columns; 64 sequences, 4 configurations,
4 schedulers, 4 fetch budgets, layers x KV heads x query heads x steps making up the rest).

Usage::

    python benchmarks/bench_tiers_reader.py --rows 1e6 1e7 [--readers whole duckdb] [--work DIR]

The load average is printed with each line: on a loaded machine CPU seconds are guidance and
wall seconds are not results; peak memory is.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

_CHILD = """
import sys, time
import pyarrow.parquet as pq
from tracesim.analysis.tiers import curves_tables, read_scheduler_curves, scheduler_curves
t0 = time.process_time()
if sys.argv[2] == "whole":
    curves = scheduler_curves(pq.read_table(sys.argv[1]).to_pandas())
else:
    curves = read_scheduler_curves(sys.argv[1])
curves_tables(curves)
# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec (the parent's size at the fork)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status")
           if line.startswith("VmHWM:"))
print(f"{time.process_time() - t0:.1f} {hwm / 1024:.0f} {len(curves)}")
"""


def write_tiers(path: Path, rows: int, batch: int = 1 << 20, seed: int = 0) -> int:
    """A synthetic tiers.parquet of ``rows`` rows, written a batch at a time."""
    rng = np.random.default_rng(seed)
    unit = 4 * 4 * 4 * 8 * 2 * 2  # configs x schedulers x budgets x layers x kv x heads
    steps = max(1, rows // (64 * unit))
    written = 0
    writer = None
    while written < rows:
        n = min(batch, rows - written)
        i = np.arange(written, written + n)
        cols = {"sequence_id": np.char.add("s", (i // (unit * steps) % 64).astype(str)),
                "config_id": np.char.add("cfg", (i // 1 % 4).astype(str)),
                "scheduler": np.array(["random", "confidence", "certificate", "oracle"])[
                    i // 4 % 4],
                "fetch_budget": np.array([0.0, 0.1, 0.25, 0.5])[i // 16 % 4],
                "layer": (i // 64 % 8).astype(np.int64), "kv_head": (i // 512 % 2).astype(
                    np.int64), "head": (i // 1024 % 2).astype(np.int64),
                "step": (i // unit % steps).astype(np.int64),
                "err2_before": rng.gamma(2.0, 1.0, n), "bytes_moved": rng.integers(0, 4096, n)
                * 1.0, "evicted_bytes": rng.integers(1, 9, n) * 512.0,
                "stall_ms": rng.gamma(1.0, 0.1, n), "fetch_ms": rng.gamma(1.0, 0.05, n)}
        cols["err2_after"] = cols["err2_before"] * rng.uniform(0, 1, n)
        table = pa.table(cols)
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema)
        writer.write_table(table, row_group_size=1 << 17)
        written += n
    writer.close()
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=float, nargs="+", default=[1e6])
    ap.add_argument("--readers", nargs="+", default=["whole", "duckdb"],
                    choices=["whole", "duckdb"])
    ap.add_argument("--work", type=Path, default=None, help="scratch directory")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-tiers-"))
    work.mkdir(parents=True, exist_ok=True)
    for target in args.rows:
        path = work / f"tiers-{int(target)}.parquet"
        rows = write_tiers(path, int(target))
        for reader in args.readers:
            load = os.getloadavg()[0]
            out = subprocess.run([sys.executable, "-c", _CHILD, str(path), reader],
                                 capture_output=True, text=True,
                                 check=True).stdout.strip().splitlines()[-1].split()
            print(f"{reader:<7} {rows:>12,} rows  CPU {out[0]:>7} s  peak {out[1]:>6} MB  "
                  f"{out[2]} curves  load {load:.2f}", flush=True)
        path.unlink()


if __name__ == "__main__":
    main()
