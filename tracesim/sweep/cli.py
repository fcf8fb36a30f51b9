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
        "file per task, then publish them as the dataset OUT/results/ (parts/, one per task; "
        "manifest.json with every part's rows and sha256; summary.json). Rerunning skips "
        "finished tasks. See docs/sweeps.md.",
        epilog="examples:\n  tracesim sweep data/sweeps/example.yaml --dry-run\n"
        "  tracesim sweep data/sweeps/example.yaml --workers 2 --out sweep-out/")
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
                   help="address of an existing Dask scheduler, e.g. tcp://host:8786 "
                   "(implies --backend dask; default: start a local cluster)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (default: the spec's 'output')")
    p.add_argument("--retries", type=int, default=2,
                   help="resubmissions of a failed task before it counts as failed (default 2)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_sweep_command)


#: Seconds to wait for a ``--scheduler`` to accept a connection before giving up.
SCHEDULER_CONNECT_TIMEOUT_S = 5.0


def check_scheduler(address: str, timeout: float = SCHEDULER_CONNECT_TIMEOUT_S) -> None:
    """Fail fast (UsageError) unless ``address`` (``tcp://host:port``) accepts a TCP
    connection within ``timeout`` seconds."""
    import socket
    from urllib.parse import urlsplit

    from tracesim.errors import UsageError

    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or port is None:
        raise UsageError(f"--scheduler {address!r}: expected an address 'tcp://HOST:PORT'")
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        raise UsageError(f"--scheduler {address!r}: cannot connect within {timeout:g} s "
                         f"({exc.strerror or exc}), expected a running Dask scheduler") from None


def run_sweep_command(args: argparse.Namespace) -> int:
    """Run the ``sweep`` subcommand; return an exit code (2: bad spec, 1: failed tasks)."""
    from tracesim.errors import UsageError, check_int, check_out_dir, check_threads
    from tracesim.sweep import SpecError, describe, load_spec, run_sweep

    try:
        check_int(args.workers, "--workers", 1, 1024)
        check_threads(args.threads_per_worker, "--threads-per-worker")
        check_int(args.retries, "--retries", 0, 100)
        if args.out is not None:
            check_out_dir(args.out)
        if args.scheduler is not None:
            check_scheduler(args.scheduler)
    except UsageError as exc:
        print(f"tracesim sweep: {exc}", file=sys.stderr)
        return 2
    import warnings

    from tracesim.policies.grid import BudgetWarning

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", BudgetWarning)
            spec = load_spec(args.spec, output=args.out)
        for w in caught:
            if issubclass(w.category, BudgetWarning):
                print(f"tracesim sweep: warning: {w.message}", file=sys.stderr)
            else:  # pragma: no cover - anything else keeps its usual display
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
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
