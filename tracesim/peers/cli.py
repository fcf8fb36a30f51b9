"""``tracesim peers STORE --out DIR``: replay MagicPIG, vAttention and Quest over a store."""

from __future__ import annotations

import argparse
import sys

__all__ = ["LEGACY_FILES", "register", "run_peers"]

_EPILOG = ("example:\n  tracesim peers traces/ --peer magicpig,vattention,quest --seeds 8 "
           "--layers 0:30:3 --out results/peers\n"
           "  tracesim peers traces/ --peer vattention --peer-params "
           "'{\"vattention\": {\"sinks\": 4, \"local\": 32}}' --out results/peers-small")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``peers`` subcommand."""
    p = subparsers.add_parser(
        "peers", help="replay MagicPIG, vAttention and Quest as their reference code defines "
        "them (Parquet results)",
        description="Replay published sparse-attention methods at every decode step of a "
        "trace store, each as its reference code defines it (docs/peers.md), with its own "
        "guarantee checked where it states one and tracesim's certificate on its samples; "
        "writes the results dataset OUT/results/ (parts/, manifest.json, summary.json, "
        "peers.json; a rerun resumes).", epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", metavar="TRACES", help="trace store directory")
    p.add_argument("--peer", default="magicpig,vattention,quest",
                   help="comma-separated peers (magicpig, vattention, quest)")
    p.add_argument("--peer-params", "--params", dest="params", default="{}", metavar="JSON",
                   help="JSON mapping peer -> {parameter: value} (docs/peers.md lists them; "
                   "the name 'tracesim evict' uses; --params is an alias)")
    p.add_argument("--seeds", type=int, default=8, help="seeds 0..N-1 (hash draws, sample "
                   "draws; Quest is deterministic and runs once; default 8, at most 4096)")
    p.add_argument("--layers", default=None, help="START:STOP:STEP or a comma-separated list "
                   "(default: every layer)")
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace earlier peers results in --out")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run_peers)


def _layers(text: str | None, n_layers: int) -> list[int] | None:
    from tracesim.counts import parse_layers

    return None if text is None else parse_layers(text, n_layers, "--layers", ValueError)


def _peer_names(text: str) -> list[str]:
    """``--peer``: distinct names (a peer given twice would write every row twice under
    identical keys)."""
    from tracesim.counts import Count

    names = [n.strip() for n in text.split(",") if n.strip()]
    Count("peers", 16).check_items(names, "--peer", ValueError)
    return names


def run_peers(args: argparse.Namespace) -> int:
    """Run ``peers``; 0 on success, 2 on a user error."""
    from tracesim.errors import UsageError
    from tracesim.outpaths import check_output
    from tracesim.peers import make_peer
    from tracesim.safeio import loads_json
    from tracesim.store import StoreError, open_store

    try:
        from tracesim.counts import TIERS_SEEDS

        TIERS_SEEDS.check(args.seeds, "--seeds", ValueError)
        out = check_output(args.out, [("trace store", args.traces)])
        results = out / "results"
        if results.is_symlink() or (results.exists() and not results.is_dir()):
            raise ValueError(f"{results}: is not a directory, expected the results dataset "
                             "directory (or nothing)")
        params = loads_json(args.params, "--peer-params")
        if not isinstance(params, dict) or not all(isinstance(v, dict)
                                                   for v in params.values()):
            raise ValueError("--peer-params: expected a JSON mapping {peer: {parameter: value}}")
        names = _peer_names(args.peer)
        unknown = set(params) - set(names)
        if unknown:
            raise ValueError(f"--peer-params: {sorted(unknown)} not in --peer {names}")
        peers = [make_peer(n, **params.get(n, {})) for n in names]
        if not peers:
            raise ValueError("--peer: expected at least one peer")
        store = open_store(args.traces, require_rows=True)
        layers = _layers(args.layers, store.model.n_layers)
        from tracesim.atomic import check_file_targets

        check_file_targets(out, list(LEGACY_FILES))  # removed once the new results are in
        for name in ("results/manifest.json", *LEGACY_FILES):
            if (out / name).exists() and not args.overwrite:
                raise ValueError(f"{out / name} exists; expected a new --out or --overwrite")
    except (ValueError, StoreError, UsageError) as exc:
        print(f"tracesim peers: {exc}", file=sys.stderr)
        return 2
    from tracesim.atomic import DirLock, remove_stale_tmp
    from tracesim.digests import prereg_record
    from tracesim.peers.run import write_peers_dataset
    from tracesim.version import __version__

    out.mkdir(parents=True, exist_ok=True)
    try:
        lock = DirLock(out, "peers")
    except ValueError as exc:  # another run writes there
        print(f"tracesim peers: {exc}", file=sys.stderr)
        return 2
    try:
        remove_stale_tmp(out)
        rows = write_peers_dataset(
            out, store, peers, args.seeds, layers, progress=not args.quiet,
            prereg=prereg_record(None, args.traces),
            run_doc={"tool": "peers", "version": __version__,
                     "peers": [p.label() for p in peers], "seeds": args.seeds,
                     "layers": layers})
    except (ValueError, UsageError) as exc:
        print(f"tracesim peers: {exc}", file=sys.stderr)
        return 2
    finally:
        lock.release()
    for name in LEGACY_FILES:  # superseded by results/ (written by an earlier version)
        (out / name).unlink(missing_ok=True)
    print(f"{rows} rows -> {out / 'results'}/ (parts/, manifest.json)")
    return 0


#: The files earlier versions wrote, removed once the results dataset replaces them.
LEGACY_FILES = ("peers.parquet", "peers.json")
