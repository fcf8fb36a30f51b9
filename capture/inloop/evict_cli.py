"""The ``tracesim evict`` subcommand: arguments, the grid file, fetch and peer options.

Every input is checked here before :func:`tracesim.capture.inloop.evict_run.run_evict` loads the
model;
a bad value exits 2 naming the option or field (``docs/evict.md``).
"""

from __future__ import annotations

import argparse
from typing import Any

from tracesim.capture.inloop.evict_run import _check_fetch, run_evict

__all__ = ["register"]


def _print_summary(summary: dict[str, Any]) -> None:
    print(f"{summary['n_rows']} outcome rows ({summary['sequences_written']} sequences written, "
          f"{summary['sequences_skipped']} already done) in {summary['wall_seconds']:.1f} s")
    for config, acc in sorted(summary.get("accuracy", {}).items()):
        print(f"  accuracy {acc:5.2f}  {config}")
    for r in summary.get("fetch", {}).get("accuracy", []):
        print(f"  accuracy {r['accuracy']:5.2f}  bytes {r['bytes_share']:6.1%}  "
              f"{r['fetch_scheduler']}@{r['fetch_budget']:g}  {r['config_id']}")


def _command(args: argparse.Namespace) -> int:
    from tracesim.counts import SEEDS
    from tracesim.errors import UsageError
    from tracesim.outpaths import check_output
    from tracesim.policies.grid import parse_grid
    from tracesim.safeio import read_yaml

    check_output(args.out, [("trace store", args.traces), ("evict grid", args.grid),
                            ("tiers spec", args.tiers_spec)])
    try:
        doc = read_yaml(args.grid, "evict grid")
    except OSError as exc:
        raise UsageError(f"{args.grid}: cannot read the grid ({exc.strerror or exc}), expected "
                         "a YAML file") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{args.grid}: expected a mapping with 'grid' (and 'seeds')")
    from tracesim.policies.cli_grid import overlay_options

    grid = overlay_options(doc.get("grid", doc), args)
    policies = parse_grid(grid, where=f"{args.grid}: grid")
    seeds = args.seeds if args.seeds is not None else doc.get("seeds", 4)
    SEEDS.check(seeds, f"{args.grid}: seeds" if args.seeds is None else "--seeds")
    fetch = _fetch_configs(args)
    if fetch:
        _check_fetch(policies, fetch)
    peers = None
    if args.peer is not None or args.peer_params != "{}":
        from tracesim.capture.inloop.peers import peers_from_cli

        peers = peers_from_cli(args.peer, args.peer_params)
    confkv = None
    if args.confkv is not None or args.confkv_params != "{}":
        from tracesim.capture.inloop.confkv_loop import confkv_from_cli

        confkv = confkv_from_cli(args.confkv, args.confkv_params)
    sequences = (None if args.per_task is None else _first_per_task(args.traces, args.per_task))
    summary = run_evict(args.traces, policies, seeds=seeds, out=args.out, model=args.model,
                        max_new_tokens=args.max_new_tokens, device=args.device,
                        layer_certificate=not args.no_layer_certificate, fetch=fetch,
                        peers=peers, sequences=sequences, confkv=confkv)
    _print_summary(summary)
    return 0


def _first_per_task(traces: str, n: int) -> list[str]:
    """The first ``n`` sequences of each task, in manifest order (``--per-task``)."""
    from tracesim.errors import UsageError
    from tracesim.store import open_store

    if n < 1:
        raise UsageError(f"--per-task {n}: expected a positive number of sequences per task")
    manifest = open_store(traces).manifest
    taken: dict[str, int] = {}
    out = []
    for sid, task in zip(manifest.column("sequence_id").to_pylist(),
                         manifest.column("task").to_pylist(), strict=True):
        if taken.get(task, 0) < n:
            taken[task] = taken.get(task, 0) + 1
            out.append(sid)
    return out


def _fetch_configs(args: argparse.Namespace) -> list[Any] | None:
    """The fetch configurations of ``--fetch``, ``--fetch-budget`` and ``--tiers-spec``."""
    from tracesim.errors import UsageError

    if args.fetch is None:
        for opt, val in (("--fetch-budget", args.fetch_budget), ("--tiers-spec",
                                                                  args.tiers_spec)):
            if val is not None:
                raise UsageError(f"{opt}: only applies with --fetch SCHEDULERS")
        return None
    from tracesim.tiers.model import MemoryModel, TierError, load_memory_model

    scheds = [s.strip() for s in args.fetch.split(",") if s.strip()]
    if not scheds:
        raise UsageError("--fetch: expected comma-separated schedulers, e.g. "
                         "none,random,certificate_page")
    raw = args.fetch_budget if args.fetch_budget is not None else "0.1"
    budgets = []
    for item in raw.split(","):
        try:
            budgets.append(float(item))
        except ValueError:
            raise UsageError(f"--fetch-budget {raw!r}: {item!r} is not a number; expected "
                             "comma-separated fractions in [0, 1]") from None
    if args.tiers_spec is None:
        memory = MemoryModel()
    else:
        try:
            memory = load_memory_model(args.tiers_spec)
        except TierError as exc:
            raise UsageError(f"--tiers-spec {exc}") from None
        except OSError as exc:
            raise UsageError(f"--tiers-spec {args.tiers_spec}: cannot read it "
                             f"({exc.strerror or exc}), expected a YAML file") from None
    from tracesim.capture.inloop.fetch import (
        FetchConfig,  # torch: imported once every input is checked
    )

    configs = []
    for s in dict.fromkeys(scheds):
        for b in ([0.0] if s == "none" else dict.fromkeys(budgets)):
            configs.append(FetchConfig(s, b, memory))
    return configs


def register(subparsers: Any) -> None:
    """Add ``tracesim evict``."""
    p = subparsers.add_parser(
        "evict", help="run eviction policies inside the model and record end-to-end outcomes",
        description="For each sequence of the trace store: one full-cache prefill, then one "
        "greedy decode per (policy, seed) with the eviction enforced inside attention. "
        "Writes one outcomes row per (sequence, policy, seed) — correct, full_correct, "
        "failure, log-prob and certificate summaries — to OUT/outcomes.parquet and "
        "OUT/summary.json. Resumable: finished sequences are kept. See docs/evict.md.",
        epilog="example (evict.yaml: 'grid: {score: [snapkv, full], design: [topk, poisson], "
        "budget: [0.25, 0.5]}'):\n"
        "  tracesim evict traces/ --grid evict.yaml --seeds 2 --out outcomes/")
    p.add_argument("traces", help="trace store whose sequences to run")
    p.add_argument("--grid", required=True,
                   help="YAML file with a 'grid' (the sweep spec's grid grammar, docs/sweeps.md) "
                   "and optionally 'seeds'")
    p.add_argument("--out", default="outcomes", help="output directory (resumable)")
    p.add_argument("--model", default="smollm2", help="'smollm2', 'gemma3-270m' or a "
                   "local checkpoint dir (the store's model)")
    p.add_argument("--seeds", type=int, default=None,
                   help="number of seeds (default: the grid file's 'seeds', else 4)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="generated tokens per run (default: as many as the captured full-cache "
                   "generation)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda or cuda:N")
    p.add_argument("--per-task", type=int, default=None, metavar="N",
                   help="run only the first N sequences of each task, in manifest order (the "
                   "rest can be added later into the same --out: finished sequences are kept) "
                   "(default: every sequence of the store)")
    p.add_argument("--no-layer-certificate", action="store_true",
                   help="skip the per-layer output-space certificate (cheaper decode steps)")
    p.add_argument("--fetch", default=None, metavar="SCHEDULERS",
                   help="comma-separated fetch schedulers enforced in the loop at every decode "
                   "step and layer: none, random, certificate, certificate_page, "
                   "certificate_bound, bound, oracle "
                   "(default: no fetching; one-shot policies only; docs/tiers.md)")
    p.add_argument("--fetch-budget", default=None, metavar="FRACTIONS",
                   help="comma-separated byte budgets per decode step and layer, fractions in "
                   "[0, 1] of the layer's evicted bytes (default: 0.1; with --fetch)")
    p.add_argument("--tiers-spec", default=None, metavar="YAML",
                   help="tiers spec whose 'memory' section (page, bytes_per_element, tiers) "
                   "the fetches use (default: the documented defaults; with --fetch)")
    p.add_argument("--peer", default=None, metavar="NAMES",
                   help="comma-separated peers run in the loop besides the grid, each with its "
                   "own estimator at every decode step: magicpig, vattention, quest "
                   "(default: none; docs/evict.md, docs/peers.md)")
    p.add_argument("--peer-params", default="{}", metavar="JSON",
                   help="peer parameters, e.g. '{\"quest\": {\"budget\": 0.25}}' (with --peer; "
                   "the grammar of 'tracesim peers --peer-params')")
    p.add_argument("--confkv", default=None, metavar="NAMES",
                   help="comma-separated Conf-KV family configurations run in the loop besides "
                   "the grid: confkv (per-step budget from the model's confidence), fixed (its "
                   "ranking and window at a fixed share), streaming (sinks + recent tokens) "
                   "(default: none; docs/evict.md, 'Conf-KV')")
    p.add_argument("--confkv-params", default="{}", metavar="JSON",
                   help="their fields, e.g. '{\"fixed\": {\"budget\": 0.2}}' (with --confkv; "
                   "fixed and streaming need a budget share)")
    from tracesim.policies.cli_grid import add_design_options

    add_design_options(p)
    p.set_defaults(func=_command)
