"""``tracesim validate DIR``: check a trace store from the command line."""

from __future__ import annotations

import argparse
import sys

from .format import SCHEMA_VERSION, StoreError
from .reader import open_store
from .validate import validate_store


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``validate`` subcommand to the ``tracesim`` parser."""
    parser = subparsers.add_parser(
        "validate",
        help="check a trace store (schema, shapes, checksums, NaN/Inf, boundaries)",
        description="Check a trace store. Prints 'OK' and a one-line summary, or every "
        "problem found (naming the file and field); exits 1 on any problem.",
        epilog="example:\n  tracesim validate traces/\n  tracesim validate traces/ --quick",
    )
    parser.add_argument("dir", metavar="DIR", help="trace store directory")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="structure only: skip checksums and the NaN/Inf and h2o scans",
    )
    parser.set_defaults(func=run_validate)


def summary(path: str) -> str:
    """One-line description of a (valid) store."""
    store = open_store(path)
    m = store.model
    n_bytes = sum(store.manifest.column("n_bytes").to_pylist())
    n_pos = store.manifest.column("n_positions").to_pylist()
    span = f", {min(n_pos)}-{max(n_pos)} positions" if n_pos else ""
    return (
        f"{path}: {len(store)} sequence(s){span}, {n_bytes / 1e6:.1f} MB; model "
        f"{m.model_id} ({m.architecture}, {m.n_layers} layers, {m.n_heads} heads / "
        f"{m.n_kv_heads} kv heads, head_dim {m.head_dim}, {m.dtype}"
        f"{', o_proj' if store.has_o_proj else ''}); schema v{SCHEMA_VERSION}"
    )


def run_validate(args: argparse.Namespace) -> int:
    """Run ``validate``; return 0 when the store is valid, 1 otherwise."""
    problems = validate_store(args.dir, check_data=not args.quick)
    if not problems:
        try:
            line = summary(args.dir)
        except StoreError as exc:  # pragma: no cover - validate_store would have said so
            problems = [str(exc)]
        else:
            print(f"OK {line}")
            return 0
    for problem in problems:
        print(problem)
    print(f"FAILED: {len(problems)} problem(s) in {args.dir}", file=sys.stderr)
    return 1
