"""``tracesim replay TRACES ...``: replay a grid of policies and write a Parquet results file."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

__all__ = ["register", "run_replay", "summary_table"]


def _csv(kind):
    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        return [kind(t) for t in items]
    return parse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``replay`` subcommand."""
    p = subparsers.add_parser(
        "replay", help="replay eviction policies over a trace store (Parquet results)",
        description="Replay every score x design x budget combination (comma-separated "
        "lists form a grid) over a trace store and write OUT/replay.parquet, "
        "OUT/configs.json and a printed summary. See docs/replay.md.")
    p.add_argument("traces", metavar="TRACES", help="trace store directory")
    p.add_argument("--score", type=_csv(str), default=["snapkv"],
                   help="scores (streaming,h2o,snapkv,tova,knorm,vnorm,keyformer,random,oracle,"
                        "full)")
    p.add_argument("--design", type=_csv(str), default=["topk", "poisson"],
                   help="designs (topk,poisson,bernoulli,fixed)")
    p.add_argument("--budget", type=_csv(float), default=[0.25],
                   help="budgets: fractions of the context (<= 1) or token counts (> 1)")
    p.add_argument("--correction", default="auto", choices=("auto", "none", "hajek"))
    p.add_argument("--allocator", default="uniform", choices=("uniform", "adakv", "pyramidkv"))
    p.add_argument("--schedule", default="oneshot",
                   help="'oneshot' or 'decode:K' (evict every K decode steps)")
    p.add_argument("--mixture", type=float, default=None,
                   help="defensive mixture of poisson/fixed designs (default 0)")
    p.add_argument("--floor", type=float, default=None,
                   help="lower bound on every tail pi of poisson/fixed designs, in [0, 1) "
                        "(default 0)")
    p.add_argument("--window", type=int, default=None, help="override every score's window")
    p.add_argument("--summary-page", type=_csv(int), default=[0], metavar="P",
                   help="page sizes in positions (comma-separated, swept) of the summaries "
                   "kept for the tokens a policy does not keep, which give the deterministic "
                   "bound (columns bound2, bound_cov, summary_tokens); 0 = none (default 0)")
    p.add_argument("--seeds", type=int, default=32, help="number of seeds (default 32)")
    p.add_argument("--layers", type=_csv(int), default=None, help="layers (default: all)")
    p.add_argument("--sequences", type=_csv(str), default=None,
                   help="sequence ids (default: all)")
    p.add_argument("--per-seed", action="store_true", help="one row per seed (small runs)")
    p.add_argument("--satterthwaite", action="store_true",
                   help="also compute tr(V^2) for the vector-level event (slow)")
    p.add_argument("--no-output-space", action="store_true",
                   help="skip the per-layer output-space (GQA) certificate and error")
    p.add_argument("--threads", type=int, default=None, help="numba threads")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=run_replay)


def summary_table(table: pa.Table) -> str:
    """Mean error, certificate and coverage per policy, as aligned text."""
    g = table.group_by(["config_id", "score", "design", "correction", "budget"]).aggregate([
        ("err2", "mean"), ("rel_err", "mean"), ("cert2", "mean"), ("wald_cov", "mean"),
        ("wald_t_cov", "mean"), ("kept_tokens", "mean"), ("nominal_tokens", "mean"),
        ("evicted_mass", "mean"), ("n_seeds", "max"), ("err2", "count")])
    g = g.sort_by([("score", "ascending"), ("budget", "ascending"), ("design", "ascending")])
    head = (f"{'score':<10} {'design':<9} {'corr':<5} {'budget':>6} {'kept':>7} {'err2':>10} "
            f"{'rel_err':>8} {'cert2':>10} {'wald':>6} {'wald_t':>6} {'evict':>6} "
            f"{'seeds':>5} {'rows':>6}")
    lines = [head, "-" * len(head)]

    def num(v, fmt):
        width = int(fmt.split(".")[0])
        if v is None or (isinstance(v, float) and np.isnan(v)):
            return "-".rjust(width)
        return format(v, fmt)

    for r in g.to_pylist():
        lines.append(
            f"{r['score']:<10} {r['design']:<9} {r['correction']:<5} "
            f"{num(r['budget'], '6.3g')} {num(r['kept_tokens_mean'], '7.1f')} "
            f"{num(r['err2_mean'], '10.4g')} {num(r['rel_err_mean'], '8.3f')} "
            f"{num(r['cert2_mean'], '10.4g')} {num(r['wald_cov_mean'], '6.3f')} "
            f"{num(r['wald_t_cov_mean'], '6.3f')} {num(r['evicted_mass_mean'], '6.3f')} "
            f"{r['n_seeds_max']:>5} {r['err2_count']:>6}")
    return "\n".join(lines)


def build_policies(args: argparse.Namespace) -> list:
    """The grid the arguments describe."""
    from tracesim.policies import SCORES, policy_grid

    score_params = {}
    if args.window is not None:
        score_params = {s: {"window": args.window} for s in SCORES if s != "full"}
    common = {}
    if args.mixture is not None:
        common["mixture"] = args.mixture
    if args.floor is not None:
        if not 0.0 <= args.floor < 1.0:
            raise ValueError(f"--floor = {args.floor}: expected a value in [0, 1)")
        common["floor"] = args.floor
    design_params = {"poisson": dict(common), "fixed": dict(common)} if common else {}
    out: dict = {}
    for page in args.summary_page:
        if page < 0:
            raise ValueError(f"--summary-page {page}: expected a page size >= 1 (positions per "
                             f"page) or 0 for no summaries")
        for p in policy_grid(args.score, args.design, args.budget, correction=args.correction,
                             schedule=args.schedule, allocator=args.allocator,
                             design_params=design_params, score_params=score_params,
                             summary_page=page):
            out.setdefault(p.id, p)
    return list(out.values())


def run_replay(args: argparse.Namespace) -> int:
    """Run the ``replay`` subcommand; return an exit code."""
    from tracesim.replay import ReplayOptions, iter_replay, result_schema
    from tracesim.store import StoreError, open_store

    try:
        policies = build_policies(args)
        store = open_store(args.traces)
    except (ValueError, StoreError) as exc:
        print(f"tracesim replay: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        import numba

        numba.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "configs.json").write_text(json.dumps(
        [json.loads(p.to_json()) | {"id": p.id} for p in policies], indent=1))
    options = ReplayOptions(output_space=not args.no_output_space,
                            satterthwaite=args.satterthwaite)
    path = out / "replay.parquet"
    t0 = time.perf_counter()
    try:
        with pq.ParquetWriter(path, result_schema()) as writer:
            for batch in iter_replay(store, policies, seeds=args.seeds, layers=args.layers,
                                     sequences=args.sequences, per_seed=args.per_seed,
                                     progress=not args.no_progress, options=options):
                writer.write_batch(batch)
    except ValueError as exc:
        print(f"tracesim replay: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - t0
    from tracesim.sweep.compact import find_prereg, sha256_file

    prereg = find_prereg(None, args.traces)
    (out / "summary.json").write_text(json.dumps({
        "store": str(args.traces), "policies": len(policies), "seeds": args.seeds,
        "wall_time_s": elapsed,
        "prereg": None if prereg is None else {"path": str(prereg),
                                               "sha256": sha256_file(prereg)}}, indent=1))
    table = pq.read_table(path, columns=[
        "config_id", "score", "design", "correction", "budget", "err2", "rel_err", "cert2",
        "wald_cov", "wald_t_cov", "kept_tokens", "nominal_tokens", "evicted_mass", "n_seeds"])
    print(summary_table(table))
    n_seq = len(pc.unique(pq.read_table(path, columns=["sequence_id"])["sequence_id"]))
    print(f"\n{table.num_rows} rows ({len(policies)} policies, {n_seq} sequence(s), "
          f"{args.seeds} seeds) in {elapsed:.1f} s -> {path}")
    return 0
