"""``tracesim sweep SPEC``: run (or resume) a declarative sweep; ``--dry-run`` to plan only."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["register", "run_sweep_command"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``sweep`` subcommand."""
    p = subparsers.add_parser(
        "sweep", help="run a declarative sweep (YAML spec) locally or on Dask; resumable",
        description="Replay the spec's grid of policies over its trace stores, one Parquet "
        "file per task, then compact them into OUT/results/results.parquet and "
        "OUT/results/summary.json. Rerunning skips finished tasks. See docs/sweeps.md.")
    p.add_argument("spec", metavar="SPEC", help="sweep spec (YAML)")
    p.add_argument("--dry-run", action="store_true",
                   help="print tasks, estimated work and time, and the output layout; run "
                   "nothing")
    p.add_argument("--no-calibrate", action="store_true",
                   help="with --dry-run: skip the one-layer timing behind the time estimate")
    p.add_argument("--backend", choices=("local", "dask"), default="local",
                   help="local process pool (default) or Dask distributed")
    p.add_argument("--workers", type=int, default=None,
                   help="worker processes (default: one per core)")
    p.add_argument("--threads-per-worker", type=int, default=None,
                   help="numba/BLAS threads per worker (default 1: one worker = one core)")
    p.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="address of an existing Dask scheduler (implies --backend dask)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (overrides the spec's output)")
    p.add_argument("--retries", type=int, default=2,
                   help="resubmissions of a failed task before it counts as failed (default 2)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_sweep_command)


def run_sweep_command(args: argparse.Namespace) -> int:
    """Run the ``sweep`` subcommand; return an exit code (2: bad spec, 1: failed tasks)."""
    from tracesim.sweep import SpecError, describe, load_spec, run_sweep

    for name in ("workers", "threads_per_worker"):
        value = getattr(args, name)
        if value is not None and value < 1:
            print(f"tracesim sweep: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        spec = load_spec(args.spec, output=args.out)
        if args.dry_run:
            print(describe(spec, workers=args.workers, threads=args.threads_per_worker,
                           calibrate_time=not args.no_calibrate))
            return 0
        summary = run_sweep(spec, backend=args.backend, workers=args.workers,
                            threads_per_worker=args.threads_per_worker,
                            scheduler=args.scheduler, progress=not args.no_progress,
                            retries=args.retries)
    except (SpecError, RuntimeError) as exc:
        print(f"tracesim sweep: {exc}", file=sys.stderr)
        return 2
    t = summary.tasks
    print(f"{summary.name}: {t['done']} task(s) run, {t['skipped']} already finished, "
          f"{t['failed']} failed ({t['retries']} retries) of {t['total']} in "
          f"{summary.wall_time_s:.1f} s on {summary.backend} ({summary.workers} x "
          f"{summary.threads_per_worker} thread(s))")
    for failure in summary.failures:
        print(f"  FAILED {failure['task']}: {failure['error']}", file=sys.stderr)
    if summary.complete:
        print(f"{summary.n_rows} rows -> {summary.results}")
    else:
        print("incomplete: rerun the same command to retry the failed tasks", file=sys.stderr)
    print(json.dumps({"summary": f"{summary.output}/results/summary.json"}))
    return 0 if summary.complete else 1
