"""Claim C0: deterministic eviction cannot know what it destroyed — a constructive demo.

Take a deterministic top-k policy and one (sequence, layer, head) of a trace. Perturb the values
of the tokens it evicts, ``v_i <- v_i + t * delta``, for ``t`` on a grid. Every retained key,
value and score is bit-identical (we hash them), so any estimator computed from the retained
cache returns the same number, while the true error grows without bound in ``t``. Contrast:
a Poisson design (Hájek) with the same score and budget gives the perturbed tokens a positive
inclusion probability, so some seeds sample them and its certificate grows with ``t``.

``delta`` is a fixed random unit direction (seed 0) scaled by the RMS value norm of the head,
so ``t`` is in units of a typical ``|v|``.

With page summaries of the evicted tokens retained (``summary_page > 0``, ``docs/bounds.md``)
the perturbation is *seen*: the top-k cache stays bit-identical, but the deterministic bound
computed from it and the summaries (``topk_bound2``) grows with ``t``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tracesim.kernels import replay as K
from tracesim.kernels.bounds import B_BOUND
from tracesim.layer_trace import LayerTrace
from tracesim.policies import make_policy
from tracesim.replay.engine import ReplayOptions, replay_layer
from tracesim.replay.inclusion import seed_uniforms

__all__ = ["impossibility_demo", "register", "retained_hash"]

DEFAULT_GRID = (0.0, 1.0, 10.0, 100.0, 1000.0)


def retained_hash(trace: LayerTrace, kv_head: int, pi: np.ndarray, scores: np.ndarray) -> str:
    """sha256 of what a deterministic cache retains: positions, keys, values and scores."""
    kept = np.flatnonzero(pi >= 1.0)
    h = hashlib.sha256()
    for a in (kept.astype(np.int64), trace.keys[kv_head, kept], trace.values[kv_head, kept],
              scores[kept[kept < scores.size]]):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def impossibility_demo(trace: LayerTrace, *, score: str = "snapkv", budget: float = 0.25,
                       head: int = 0, grid: tuple[float, ...] = DEFAULT_GRID, seeds: int = 64,
                       mixture: float = 0.1, n_layers: int = 1,
                       score_params: dict | None = None, summary_page: int = 16) -> pa.Table:
    """Run the demo on one layer and return one row per ``t``.

    Parameters
    ----------
    trace : LayerTrace
        One layer of one sequence.
    score : str
        Score of both policies (top-k and Poisson); its rule must not read the evicted values
        (true of every score but ``vnorm``, for which the table shows the hash changing).
    budget : float
        Fraction of the context (or tokens if > 1).
    head : int
        Query head whose errors are reported (its KV head's evicted values are perturbed).
    grid : tuple of float
        Perturbation sizes ``t``.
    seeds : int
        Seeds of the Poisson design.
    mixture : float
        Defensive mixture of the Poisson design (gives every tail token ``pi > 0``).
    n_layers : int
        Layers of the model (only PyramidKV budgets use it).
    score_params : dict, optional
        Score hyperparameters (e.g. ``{"window": 8}`` for short traces).
    summary_page : int, default 16
        Page size of the top-k policy's missing-token summaries (0: no bound).

    Returns
    -------
    pyarrow.Table
        Columns: ``t``, ``topk_retained_hash``, ``topk_identical`` (hash equals the ``t = 0``
        one), ``topk_err2``, ``topk_cert2`` (NaN: no certificate), ``topk_bound2`` (the
        page-summary bound squared, NaN without summaries), ``poisson_err2``,
        ``poisson_cert2``, ``poisson_wald_cov``, ``poisson_seeds_sampling_perturbed``,
        ``evicted_tokens``, ``evicted_mass`` — errors and certificates are means over the
        evaluated queries (and seeds).
    """
    g = head // trace.group_size
    topk = make_policy(score, "topk", budget, score_params=score_params,
                       summary_page=summary_page)
    pois = make_policy(score, "poisson", budget, score_params=score_params,
                       design_params={"mixture": mixture})
    opts = ReplayOptions(output_space=False)
    base = replay_layer(trace, [topk], np.arange(1), n_layers, opts)
    pi_topk = base.tables.pi[0, g]
    L = topk.score.compress_end(trace)
    evicted = np.flatnonzero(pi_topk[:L] == 0)
    if evicted.size == 0:
        raise ValueError(f"top-k evicts nothing at budget {budget}: the take-all stratum "
                         f"(sinks + window) already exceeds it; lower the window or raise the "
                         f"budget")
    rng = np.random.default_rng(0)
    delta = rng.standard_normal(trace.values.shape[2])
    rms = float(np.sqrt((trace.values[g] ** 2).sum(axis=1).mean()))
    delta *= rms / np.linalg.norm(delta)
    u = seed_uniforms(np.arange(seeds), trace.layer, trace.n_kv_heads, trace.n_positions)[:, g]
    rows = []
    first_hash = None
    for t in grid:
        values = trace.values.copy()
        values[g, evicted] += float(t) * delta
        # The stored outputs belong to the unperturbed trace: drop them (no output check).
        pert = replace(trace, values=values, outputs=None, _attention_cache={})
        res = replay_layer(pert, [topk, pois], np.arange(seeds), n_layers, opts)
        tk = res.out[res.tables.it_cfg == 0][0, head]
        po = res.out[res.tables.it_cfg == 1][:, head]
        pi_t = res.tables.pi[res.tables.slot_ev[res.tables.it_slot[0]], g]
        digest = retained_hash(pert, g, pi_t, topk.score.scores(pert, g, L))
        first_hash = first_hash or digest
        pi_p = res.tables.pi[res.tables.slot_ev[res.tables.it_slot[1]], g]
        if not (pi_p[evicted] > 0).any():
            raise ValueError("the Poisson design has no tail budget either (the take-all "
                             "stratum fills the budget): lower the window or raise the budget")
        sampled = (u[:, evicted] < pi_p[evicted]).any(axis=1)
        rows.append({
            "t": float(t), "topk_retained_hash": digest, "topk_identical": digest == first_hash,
            "topk_err2": float(tk[:, K.F_ERR2].mean()), "topk_cert2": float("nan"),
            "topk_bound2": (float((res.bounds[res.tables.it_cfg == 0][0, head, :, B_BOUND] ** 2)
                                  .mean()) if res.bounds is not None else float("nan")),
            "poisson_err2": float(po[..., K.F_ERR2].mean()),
            "poisson_cert2": float(po[..., K.F_CERT2].mean()),
            "poisson_wald_cov": float(np.nanmean(po[..., K.F_WALD])),
            "poisson_seeds_sampling_perturbed": float(sampled.mean()),
            "evicted_tokens": int(evicted.size),
            "evicted_mass": float(tk[:, K.F_EV_MASS].mean()),
        })
    return pa.Table.from_pylist(rows)


def format_table(table: pa.Table) -> str:
    """Aligned text rendering of the demo table."""
    head = (f"{'t':>8} {'retained hash':<17} {'same':<5} {'topk err2':>11} {'topk cert':>9} "
            f"{'topk bound2':>11} "
            f"{'pois err2':>11} {'pois cert2':>11} {'wald':>6} {'sampled':>7}")
    lines = [head, "-" * len(head)]
    for r in table.to_pylist():
        lines.append(f"{r['t']:>8g} {r['topk_retained_hash']:<17} {str(r['topk_identical']):<5} "
                     f"{r['topk_err2']:>11.4g} {'none':>9} {r['topk_bound2']:>11.4g} "
                     f"{r['poisson_err2']:>11.4g} "
                     f"{r['poisson_cert2']:>11.4g} {r['poisson_wald_cov']:>6.3f} "
                     f"{r['poisson_seeds_sampling_perturbed']:>7.2f}")
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``adversary`` subcommand."""
    p = subparsers.add_parser(
        "adversary", help="claim C0: perturb evicted values; top-k cannot see it",
        description="Perturb the values top-k evicts and show the retained cache is "
        "bit-identical while the true error grows; contrast with a Poisson design.\n\n"
        "The values of the tokens top-k evicts, in one (sequence, layer, KV head), are moved "
        "by t times a fixed random direction scaled to the head's RMS value norm (t is in "
        "units of a typical |v|). For each t the table gives the hash of what top-k retains, "
        "its true error, and the Poisson/Hájek error, certificate and coverage over the "
        "seeds. Writes OUT/adversary.parquet and OUT/adversary.json (read by tracesim report "
        "for claim C0).",
        epilog="example:\n  tracesim adversary traces/ --score snapkv --budget 0.25 "
        "--window 8 --out adversary/")
    p.add_argument("traces", metavar="TRACES", help="trace store directory")
    p.add_argument("--score", default="snapkv",
                   help="score of both the top-k and the Poisson policy (not vnorm, which "
                   "reads the perturbed values)")
    p.add_argument("--budget", type=float, default=0.25,
                   help="budget per KV head: a fraction of the context (<= 1) or tokens (> 1)")
    p.add_argument("--layer", type=int, default=None,
                   help="layer index (default: the middle layer)")
    p.add_argument("--head", type=int, default=0,
                   help="query head whose errors are reported; its KV head is perturbed")
    p.add_argument("--sequence", default=None, help="sequence id (default: the first sequence)")
    p.add_argument("--grid", default=",".join(f"{t:g}" for t in DEFAULT_GRID),
                   help="comma-separated perturbation sizes t, in units of the head's RMS "
                   "value norm")
    p.add_argument("--seeds", type=int, default=64, help="seeds of the Poisson design")
    p.add_argument("--mixture", type=float, default=0.1,
                   help="defensive mixture weight in [0, 1] of the Poisson design (gives "
                   "every tail token pi > 0)")
    p.add_argument("--window", type=int, default=None,
                   help="recent-window length in tokens (default: the score's own)")
    p.add_argument("--summary-page", type=int, default=16,
                   help="page size (positions) of the summaries top-k keeps of what it evicts, "
                   "for the deterministic bound column; 0 = none")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=run_adversary)


def _check_args(args: argparse.Namespace) -> tuple[float, ...]:
    """Every check that needs no file (finite numbers, bounded counts); the parsed --grid."""
    from tracesim.counts import SEEDS, SUMMARY_PAGE, check_finite
    from tracesim.policies.grid import MAX_INT_PARAM, MAX_TOKENS

    check_finite(args.budget, "--budget", 0.0, float(MAX_TOKENS), open_lo=True)
    if args.budget > 1 and not float(args.budget).is_integer():
        raise ValueError(f"--budget {args.budget}: a budget above 1 is a token count, expected "
                         "an integer")
    check_finite(args.mixture, "--mixture", 0.0, 1.0)
    SEEDS.check(args.seeds, "--seeds")
    SUMMARY_PAGE.check(args.summary_page, "--summary-page")
    if args.window is not None and not 0 <= args.window <= MAX_INT_PARAM:
        raise ValueError(f"--window {args.window}: expected an int in [0, {MAX_INT_PARAM}]")
    items = [t.strip() for t in args.grid.split(",") if t.strip()]
    if not items or len(items) > 1000:
        raise ValueError(f"--grid: {len(items)} perturbation sizes, expected 1 to 1000")
    grid = []
    for i, text in enumerate(items):
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"--grid[{i}]: {text[:40]!r} is not a number, expected a finite "
                             "perturbation size") from None
        # |t| bounded: t * RMS |v| must stay finite in float32 arithmetic
        grid.append(check_finite(value, f"--grid[{i}]", -1e12, 1e12, ValueError))
    return tuple(grid)


def run_adversary(args: argparse.Namespace) -> int:
    """Run the ``adversary`` subcommand."""
    from tracesim.outpaths import check_output
    from tracesim.replay import load_layer
    from tracesim.store import StoreError, open_store

    try:
        out_dir = check_output(args.out, [("trace store", args.traces)])
        from tracesim.atomic import check_file_targets

        check_file_targets(out_dir, ["adversary.parquet", "adversary.json"])  # before the work
        grid = _check_args(args)
        store = open_store(args.traces, require_rows=True)
        sid = args.sequence or store.sequence_ids[0]
        layer = store.model.n_layers // 2 if args.layer is None else args.layer
        if not 0 <= layer < store.model.n_layers:
            raise ValueError(f"--layer {layer}: outside the store's layers, expected an int in "
                             f"[0, {store.model.n_layers})")
        if not 0 <= args.head < store.model.n_heads:
            raise ValueError(f"--head {args.head}: outside the store's heads, expected an int "
                             f"in [0, {store.model.n_heads})")
        if sid not in store.sequence_ids:
            raise ValueError(f"--sequence {sid!r}: not in the store, expected one of "
                             f"{list(store.sequence_ids)[:5]}")
        trace = load_layer(store, store[sid], layer)
        table = impossibility_demo(trace, score=args.score, budget=args.budget, head=args.head,
                                   grid=grid, seeds=args.seeds, mixture=args.mixture,
                                   n_layers=store.model.n_layers,
                                   score_params=None if args.window is None
                                   else {"window": args.window},
                                   summary_page=args.summary_page)
    except (ValueError, StoreError, KeyError) as exc:
        print(f"tracesim adversary: {exc}", file=sys.stderr)
        return 2
    from tracesim.atomic import DirLock, atomic_files
    from tracesim.errors import UsageError

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"sequence": sid, "layer": layer, "head": args.head, "score": args.score,
            "budget": args.budget, "seeds": args.seeds, "mixture": args.mixture,
            "rows": table.to_pylist()}
    try:
        with DirLock(out, "adversary"), atomic_files(
                out, ["adversary.parquet", "adversary.json"]) as stage:  # both or neither
            pq.write_table(table, stage / "adversary.parquet")
            (stage / "adversary.json").write_text(json.dumps(meta, indent=1))
    except UsageError as exc:
        print(f"tracesim adversary: {exc}", file=sys.stderr)
        return 2
    print(f"C0 demo: sequence {sid}, layer {layer}, head {args.head}, {args.score} top-k vs "
          f"Poisson at budget {args.budget:g} ({args.seeds} seeds)")
    print(format_table(table))
    same = all(table.column("topk_identical").to_pylist())
    print(f"\nretained top-k cache identical for every t: {same}; "
          f"written to {out / 'adversary.parquet'}")
    return 0
