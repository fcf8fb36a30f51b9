"""``tracesim tiers STORE --spec tiers.yaml --out DIR``: simulate fetch schedulers over a store."""

from __future__ import annotations

import argparse
import sys

__all__ = ["register", "run_tiers_command"]

EXAMPLE = """example:
  tracesim tiers traces/ --spec data/tiers/example.yaml --out results/tiers
  (writes results/tiers/tiers.parquet and summary.json; rerun to resume)"""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``tiers`` subcommand."""
    p = subparsers.add_parser(
        "tiers", help="simulate certificate-scheduled fetches from DRAM/NVMe tiers",
        description="Replay fetch schedulers (none, random, confidence, certificate, "
        "certificate_page, certificate_bound, bound, oracle) over a trace store: tokens a base "
        "eviction policy drops live in pages in lower memory tiers, and at every decode step "
        "each scheduler fetches pages within a byte budget. Writes DIR/tiers.parquet (one row "
        "per sequence, layer, head, step, scheduler and fetch budget) and DIR/summary.json; "
        "resumable. See docs/tiers.md.",
        epilog=EXAMPLE)
    p.add_argument("store", metavar="STORE", nargs="?", default=None,
                   help="trace store directory (default: the spec's 'store')")
    p.add_argument("--spec", required=True, metavar="YAML",
                   help="tiers spec: base policies, seeds, schedulers, fetch budgets, memory "
                        "tiers (no default)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (no default)")
    p.add_argument("--backend", choices=("local", "dask"), default="local",
                   help="where the (sequence, policy) parts run (default: local, in this "
                        "process)")
    p.add_argument("--workers", type=int, default=2, metavar="N",
                   help="Dask LocalCluster worker processes, one core each (default: 2)")
    p.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="address of an existing Dask scheduler, e.g. tcp://host:8786 "
                        "(default: start a LocalCluster)")
    p.add_argument("--quiet", action="store_true", help="no per-part progress lines "
                                                         "(default: print them)")
    p.set_defaults(func=run_tiers_command)


def _fail(message: str) -> int:
    print(f"tracesim tiers: error: {message}", file=sys.stderr)
    return 2


def run_tiers_command(args: argparse.Namespace) -> int:
    """Run ``tracesim tiers``; user errors exit 2 with a message."""
    from tracesim.store import open_store
    from tracesim.tiers.model import TierError
    from tracesim.tiers.run import run_tiers
    from tracesim.tiers.spec import load_tiers_spec

    try:
        spec = load_tiers_spec(args.spec)
    except TierError as exc:
        return _fail(str(exc))
    store_path = args.store or spec.store
    if store_path is None:
        return _fail("no trace store: give STORE or set 'store' in the spec")
    if not 1 <= args.workers <= 256:
        return _fail(f"--workers {args.workers}: expected an int in [1, 256]")
    from tracesim.outpaths import check_output

    try:
        out = check_output(args.out, [("trace store", store_path), ("tiers spec", args.spec)])
    except ValueError as exc:
        return _fail(str(exc))
    if out.exists() and not out.is_dir():
        return _fail(f"--out {out}: exists and is not a directory")
    try:
        store = open_store(store_path, require_rows=True)
    except (OSError, ValueError) as exc:
        return _fail(f"{store_path}: cannot open the trace store ({exc})")
    try:
        summary = run_tiers(spec, store, out, backend=args.backend, workers=args.workers,
                            scheduler=args.scheduler,
                            progress=None if args.quiet else lambda s: print(s, flush=True))
    except (ValueError, RuntimeError, TimeoutError) as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"{out}: {exc.strerror or exc}")
    print(f"{summary['rows']} rows in {out / 'tiers.parquet'} ({summary['seconds']:.1f} s; "
          f"{summary['parts_resumed']} parts resumed)")
    return 0
