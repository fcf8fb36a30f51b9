"""``tracesim report``: the claims table, report.md and a standalone report.html."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["register"]

_DEFAULT_PREREG = Path(__file__).resolve().parents[1] / "data" / "prereg.yaml"


def _command(args: argparse.Namespace) -> int:
    from tracesim.analysis.prereg import PreregChangedError
    from tracesim.analysis.report import build_report, write_report

    from tracesim.outpaths import check_output

    if args.outcomes_only is not None:
        if args.outcomes is not None:
            print("tracesim report: --outcomes-only: expected no second positional outcomes "
                  "directory with it", file=sys.stderr)
            return 2
        args.outcomes = args.outcomes_only
    if args.results is None and args.outcomes is None:
        print("tracesim report: expected a results directory (or --outcomes-only DIR)",
              file=sys.stderr)
        return 2
    try:
        check_output(args.out, [("results", args.results), ("outcomes", args.outcomes),
                                ("adversary results", args.adversary),
                                ("trace store", args.traces), ("tiers results", args.tiers),
                                ("frontier results", args.frontier),
                                *(("results", d) for d in args.more_results or ()),
                                *(("peers results", d) for d in args.peers or ()),
                                ("pre-registration file", args.prereg)])
        report = build_report(args.results, args.outcomes, prereg_path=args.prereg,
                              adversary_dir=args.adversary, traces_dir=args.traces,
                              allow_prereg_change=args.allow_prereg_change,
                              tiers_dir=args.tiers, frontier_dir=args.frontier,
                              peers_dirs=args.peers or (), trust_unsigned=args.trust_unsigned,
                              scheduler=args.scheduler,
                              more_results=args.more_results or ())
    except (PreregChangedError, ValueError) as exc:
        print(f"tracesim report: {exc}", file=sys.stderr)
        return 2
    path = write_report(report, args.out)
    for note in report.notes:
        print(note)
    print(report.terminal_table())
    print(f"\nreport written to {path}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tracesim report``."""
    p = subparsers.add_parser(
        "report", help="evaluate the pre-registered claims; write the report (Markdown + "
        "standalone HTML)",
        description="Evaluate every claim of the pre-registration (data/prereg.yaml) on the "
        "replay/sweep results and the in-loop outcomes, correct the p-values with Holm, and "
        "write OUT/report.md, a standalone OUT/report.html (provenance header, sample-size "
        "caveat, claims table, captioned figures), OUT/claims.json and the figures as PNG. "
        "Refuses results produced under another pre-registration. The claims read RESULTS "
        "only; further results (--results) are descriptive: a per-step section each. See "
        "docs/report.md.",
        epilog="examples:\n  tracesim report sweep-out/ outcomes/ --adversary adversary/ "
        "--traces traces/ --out report/\n  tracesim report results/perstep-heldout --results "
        "results/perstep-lengths --peers results/peers-held --out report/perstep-held")
    p.add_argument("results", nargs="?", default=None,
                   help="replay or sweep output directory: the results the claims read "
                   "(default: none, with "
                   "--outcomes-only; the results claims are then not evaluated)")
    p.add_argument("--results", action="append", default=None, metavar="DIR",
                   dest="more_results",
                   help="a further replay or sweep output, verified as RESULTS is and reported "
                   "in a per-step section of its own (per store for a length sweep); "
                   "descriptive: the claims read RESULTS only; repeat for several (default: "
                   "none)")
    p.add_argument("outcomes", nargs="?", default=None,
                   help="evict output directory (default: none; C3, C4, C6 not evaluated)")
    p.add_argument("--outcomes-only", default=None, metavar="DIR",
                   help="an evict output directory, reported with or without replay results "
                   "(alone: C3, C4, C6, C12 and C2's end-to-end part; the results claims not "
                   "evaluated) (default: none; outcomes are the second positional)")
    p.add_argument("--out", required=True, help="report directory")
    p.add_argument("--prereg", default=str(_DEFAULT_PREREG),
                   help="pre-registration file (default: data/prereg.yaml)")
    p.add_argument("--adversary", default=None,
                   help="directory with adversary.json for C0 (default: RESULTS, if it has "
                   "one)")
    p.add_argument("--traces", default=None,
                   help="trace store: token log-probs for confidence gating (C7) and the "
                   "provenance header (default: none)")
    p.add_argument("--tiers", default=None, metavar="DIR",
                   help="tracesim tiers output: adds C7 in bytes and modelled time (default: "
                   "none)")
    p.add_argument("--frontier", default=None, metavar="DIR",
                   help="tracesim frontier output to include (default: RESULTS/frontier if "
                        "present); its validity_rules.json is checked and used for C8")
    p.add_argument("--peers", action="append", default=None, metavar="DIR",
                   help="a tracesim peers output directory (vAttention rows) for C10; repeat "
                   "for several (default: none; C10 not evaluated)")
    p.add_argument("--allow-prereg-change", action="store_true",
                   help="report even if the pre-registration changed after the results")
    p.add_argument("--trust-unsigned", action="store_true",
                   help="accept results whose summary.json records no row count and sha256 "
                   "(written before tracesim recorded them); the report carries a warning. "
                   "Tampered, duplicated or foreign rows are refused either way")
    p.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="aggregate the results with Dask on this scheduler: a distributed "
                   "scheduler's address (tcp://HOST:PORT) or threads, processes, synchronous "
                   "(default: none, DuckDB in this process; docs/sweeps.md)")
    p.set_defaults(func=_command)
