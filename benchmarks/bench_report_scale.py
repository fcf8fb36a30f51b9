"""``tracesim report`` at scale: rows/s and peak memory of the process tree on 10^6, 10^7, ...
rows built from a real sweep.

The rows are a real sweep's results dataset replicated: copy ``r`` of every part renames each
sequence ``s`` to ``s~r<r>`` (new clusters, so every result key and every (store, sequence,
layer, configuration) cell stays unique), re-keys the part's record (its key-value metadata)
and the manifest and summary are re-recorded (new sha256s), so the report verifies the scaled
dataset as it verifies a sweep's. Sequences are renamed rather than seeds shifted: rows
aggregated over seeds, and every row of a deterministic policy, have a null seed, so shifting
seeds alone cannot make their keys unique. Building streams: copy 0 is hard-linked, the others
are rewritten one row group at a time, and the disk is checked first (~72 bytes a row: 10^8
rows need ~7 GB).

Each size runs ``tracesim report`` in a child process; its peak memory is the sum over the
process tree of each process's ``VmHWM`` (read from ``/proc`` every 0.2 s while it runs, the
last value kept per process), an upper bound of the tree's simultaneous peak.

Usage::

    tracesim sweep data/sweeps/example.yaml --out /tmp/ex          # a real sweep (~550k rows)
    python benchmarks/bench_report_scale.py /tmp/ex --rows 1e6 1e7 1e8 [--work DIR] [--json]

Times taken on a loaded machine are not speed results; memory peaks are.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tracesim.dataset import META_KEY  # noqa: E402
from tracesim.digests import sha256_file  # noqa: E402


def _renamed(part: dict, r: int) -> tuple[str, str]:
    """Sequence id and task key of copy ``r`` of a part (copy 0 is the part itself)."""
    return ((part["sequence_id"] + f"~r{r}", part["key"] + f"~r{r}") if r
            else (part["sequence_id"], part["key"]))


def _copy_part(src: Path, dst: Path, part: dict, r: int) -> None:
    """Copy ``r`` of a part, rewritten row group by row group (one row group in memory) with
    its sequence renamed and its record (the file's key-value metadata) re-keyed."""
    if r == 0:
        try:
            os.link(src, dst)  # the part itself: no rewrite needed
        except OSError:
            shutil.copyfile(src, dst)
        return
    seq, key = _renamed(part, r)
    with pq.ParquetFile(src) as f:
        meta = json.loads(f.metadata.metadata[META_KEY])
        meta.update(key=key, sequence_id=seq)
        schema = f.schema_arrow.remove_metadata()
        i = schema.get_field_index("sequence_id")
        with pq.ParquetWriter(dst, schema, compression="zstd") as w:
            for g in range(f.num_row_groups):
                t = f.read_row_group(g).replace_schema_metadata(None)
                t = t.set_column(i, schema.field(i), pc.binary_join_element_wise(
                    t["sequence_id"], pa.scalar(f"~r{r}"), ""))
                w.write_table(t)
            w.add_key_value_metadata({META_KEY: json.dumps(meta, sort_keys=True)})


def scale(sweep: Path, out: Path, copies: int) -> int:
    """Write ``copies`` renamed copies of ``sweep``'s dataset as a sweep output ``out``,
    streaming: one row group in memory, the manifest entries only (not the rows)."""
    src = sweep / "results"
    man = json.loads((src / "manifest.json").read_text())
    need = copies * sum((src / p["file"]).stat().st_size for p in man["parts"])
    (out / "results" / "parts").mkdir(parents=True)
    free = shutil.disk_usage(out).free
    if need > 0.9 * free:
        raise SystemExit(f"{out}: {copies} copies need ~{need / 1e9:.1f} GB, only "
                         f"{free / 1e9:.1f} GB free there; choose another --work")
    shutil.copy(sweep / "configs.json", out / "configs.json")
    parts, width = [], max(5, len(str(copies * len(man["parts"]))))
    for r in range(copies):
        for part in man["parts"]:
            name = f"parts/part-{len(parts):0{width}d}.parquet"
            _copy_part(src / part["file"], out / "results" / name, part, r)
            seq, key = _renamed(part, r)
            parts.append(dict(part, file=name, sha256=sha256_file(out / "results" / name),
                              sequence_id=seq, key=key))
    rows = man["n_rows"] * copies
    man.update(parts=parts, n_rows=rows, n_parts=len(parts))
    (out / "results" / "manifest.json").write_text(json.dumps(man, indent=1, sort_keys=True))
    summary = json.loads((src / "summary.json").read_text())
    summary.update(n_rows=rows, results_sha256=sha256_file(out / "results" / "manifest.json"))
    (out / "results" / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    return rows


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc/*/stat)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def _status_kb(pid: int, field: str) -> int | None:
    """A ``kB`` field of ``/proc/PID/status`` (``VmHWM:``, ``VmRSS:``), or None if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _hwm_kb(pid: int) -> int | None:
    return _status_kb(pid, "VmHWM:")


def run_tree(cmd: list[str], log: Path, cap_mb: float | None = None) -> dict:
    """Run ``cmd``; its exit code, seconds and the peak VmHWM of its process tree.

    With ``cap_mb``, the tree is killed once its resident memory (VmRSS summed over the
    tree) exceeds ``cap_mb``: a reader that needs more than the machine has is shown to fail
    at the cap instead of taking the machine down (``rc`` is then ``"killed at cap"``).
    """
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=fh,
                                start_new_session=cap_mb is not None)
    peaks: dict[int, int] = {}
    capped = False
    while proc.poll() is None:
        rss = 0
        for pid in _tree(proc.pid):
            kb = _hwm_kb(pid)
            if kb is not None:
                peaks[pid] = max(peaks.get(pid, 0), kb)
            rss += _status_kb(pid, "VmRSS:") or 0
        if cap_mb is not None and rss / 1024 > cap_mb:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            capped = True
            break
        time.sleep(0.2)
    err = log.read_text()
    rc: int | str = "killed at cap" if capped else proc.returncode
    return {"rc": rc, "seconds": round(time.perf_counter() - t0, 2),
            "peak_mb": round(sum(peaks.values()) / 1024, 1), "processes": len(peaks),
            "stderr_tail": err.strip().splitlines()[-1:] if proc.returncode else []}


def run_report(results: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "tracesim.app.cli", "report", str(results), "--out", str(out)]
    return run_tree(cmd, out.with_name(out.name + ".stderr"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", type=Path, help="a tracesim sweep output (results dataset)")
    ap.add_argument("--rows", type=float, nargs="+", default=[1e6, 1e7])
    ap.add_argument("--work", type=Path, default=None, help="scratch directory")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    base = json.loads((args.sweep / "results" / "manifest.json").read_text())["n_rows"]
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-report-"))
    rows_out = []
    for target in args.rows:
        copies = max(1, math.ceil(target / base))
        d = work / f"scaled-{copies}"
        if d.exists():
            shutil.rmtree(d)
        t0 = time.perf_counter()
        rows = scale(args.sweep, d, copies)
        build = time.perf_counter() - t0
        res = run_report(d, work / f"report-{copies}")
        res.update(rows=rows, build_s=round(build, 1),
                   rows_per_s=round(rows / res["seconds"]) if res["rc"] == 0 else None)
        rows_out.append(res)
        print(f"{rows:>12,} rows  rc={res['rc']}  {res['seconds']:8.1f} s  "
              f"{res['rows_per_s'] or 0:>10,} rows/s  peak {res['peak_mb']:8.1f} MB "
              f"({res['processes']} process(es)); built in {res['build_s']} s "
              f"{res['stderr_tail']}", flush=True)
        shutil.rmtree(d, ignore_errors=True)
    if args.json:
        print(json.dumps(rows_out, indent=1))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
