"""Memory of ``tracesim report`` per stage: each claim, figure and step of the report.

Runs ``tracesim report RESULTS --out OUT`` in this process with the report's functions
wrapped. Around each one it reads ``/proc/self/status``: the resident set before, the peak
while it runs (``VmHWM``, reset at the stage's start by writing 5 to
``/proc/self/clear_refs``; a stage's peak includes the stages nested in it) and the resident
set after, and its CPU seconds. tracemalloc cannot see DuckDB's or Arrow's memory; this can.
Linux only.

Usage::

    python benchmarks/bench_report_stages.py RESULTS OUT [--json FILE]

RESULTS is any ``tracesim report`` input, e.g. a dataset built by
``bench_report_scale.scale``. Prints one line per stage to stderr and, last, the process peak
(the largest stage peak).
"""
from __future__ import annotations

import json
import sys
import time

STACK: list[dict] = []
ROWS: list[dict] = []


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1])
    return out


def _fold() -> None:
    h = _status()["VmHWM"]
    for e in STACK:
        e["peak"] = max(e["peak"], h)


def _reset() -> None:
    _fold()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def wrap(f, label):
    def w(*a, **k):
        _reset()
        st = _status()
        e = {"label": label, "depth": len(STACK), "rss0": st["VmRSS"], "peak": st["VmHWM"],
             "cpu0": time.process_time(), "t0": time.perf_counter()}
        STACK.append(e)
        try:
            return f(*a, **k)
        finally:
            _fold()
            STACK.pop()
            st = _status()
            row = {"stage": ("  " * e["depth"]) + label, "rss_before_mb": e["rss0"] / 1024,
                   "peak_mb": e["peak"] / 1024, "rss_after_mb": st["VmRSS"] / 1024,
                   "cpu_s": time.process_time() - e["cpu0"],
                   "wall_s": time.perf_counter() - e["t0"]}
            ROWS.append(row)
            print(f"[stage] {row['stage']:<44} rss0 {row['rss_before_mb']:7.0f}  peak "
                  f"{row['peak_mb']:7.0f}  (+{row['peak_mb'] - row['rss_before_mb']:6.0f})  "
                  f"rss1 {row['rss_after_mb']:7.0f}  cpu {row['cpu_s']:7.1f} s", file=sys.stderr,
                  flush=True)
    return w


def patch(mod, names, prefix=""):
    for n in names:
        if hasattr(mod, n):
            setattr(mod, n, wrap(getattr(mod, n), prefix + n))


def main() -> int:
    results, out = sys.argv[1], sys.argv[2]
    jpath = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    t_imp = time.process_time()
    import tracesim.analysis
    import tracesim.analysis.claims_gating as gating
    import tracesim.analysis.report as rep
    import tracesim.analysis.report_parts as parts
    import tracesim.analysis.validity_sums as vs
    from tracesim.analysis import figures
    from tracesim.analysis import report_figures as rfig
    from tracesim.analysis.claim_registry import BUILTIN_CLAIMS

    from tracesim.app import cli
    print(f"[stage] code: {tracesim.analysis.__file__}", file=sys.stderr)
    print(f"[stage] imports: rss {_status()['VmRSS'] / 1024:.0f} MB, cpu "
          f"{time.process_time() - t_imp:.1f} s", file=sys.stderr)
    patch(rep, ["open_results", "collect_provenance", "_evaluate", "add_replay_parts",
                "_add_perstep_section", "write_report", "build_report"])
    patch(parts, ["calibration_stats_of", "_heatmap_cells", "_add_frontier"])
    patch(rfig, ["certificate_error_figure", "coverage_level_figure", "coverage_heatmap"])
    patch(figures, ["error_budget_figure", "head_budget_figure", "recompute_figure",
                    "coverage_figure"])
    patch(vs, ["bucket_sums", "fit_rules_from_sums", "heldout_sums"], "C8.")
    patch(gating, ["c5_sequence_means", "recompute_curves", "evaluate_c7"], "")
    for c in BUILTIN_CLAIMS:
        object.__setattr__(c, "evaluate", wrap(c.evaluate, c.id))
    t0, c0 = time.perf_counter(), time.process_time()
    rc = cli.main(["report", results, "--out", out])
    print(f"[total] rc {rc} wall {time.perf_counter() - t0:.1f} s cpu "
          f"{time.process_time() - c0:.1f} s; process VmHWM (since last reset) "
          f"{_status()['VmHWM'] / 1024:.0f} MB; loadavg {open('/proc/loadavg').read().strip()}",
          file=sys.stderr)
    print(f"[peak] process peak over the run: {max(r['peak_mb'] for r in ROWS):.0f} MB",
          file=sys.stderr)
    if jpath:
        with open(jpath, "w") as fh:
            json.dump(ROWS, fh, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
