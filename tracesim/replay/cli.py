"""``tracesim replay TRACES ...``: replay a grid of policies and write a Parquet results file."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracesim.designs import DESIGNS
from tracesim.policies import SCORES
from tracesim.policies.kvpress import KVPRESS_PRESSES

__all__ = ["register", "run_replay", "summary_table"]


def _csv(kind):
    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        return [kind(t) for t in items]
    return parse


def _budget(text: str) -> tuple[float, str]:
    """A ``--budget`` item, read with the sweep spec's rule (integers are token counts)."""
    from tracesim.policies.grid import parse_budget as spec_budget

    try:
        value: float = int(text) if text.lstrip("+").isdigit() else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    try:
        return spec_budget(value, "--budget")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``replay`` subcommand."""
    p = subparsers.add_parser(
        "replay", help="replay eviction policies over a trace store (Parquet results)",
        description="Replay every score x design x budget combination (comma-separated "
        "lists form a grid) over a trace store and write the results dataset OUT/results/ "
        "(parts/, manifest.json, summary.json, configs.json; a rerun resumes) and a printed "
        "summary. See docs/replay.md and docs/sweeps.md.",
        epilog="example:\n  tracesim replay traces/ --score snapkv,h2o --design topk,poisson "
        "--budget 0.1,0.25,0.5 --seeds 16 --out replay-out/")
    p.add_argument("traces", metavar="TRACES", help="trace store directory")
    p.add_argument("--score", type=_csv(str), default=["snapkv"],
                   help="comma-separated scores ("
                   + ", ".join(s for s in SCORES if s not in KVPRESS_PRESSES)
                   + ", a kvpress press by class name, an alias or a plugin's name)")
    p.add_argument("--design", type=_csv(str), default=["topk", "poisson"],
                   help="comma-separated inclusion designs (" + ", ".join(sorted(DESIGNS))
                   + " or a plugin's name)")
    p.add_argument("--budget", type=_csv(_budget), default=[(0.25, "fraction")],
                   help="comma-separated budgets per (layer, KV head), sinks and window "
                   "included, as in a sweep spec: decimals are fractions of the context in "
                   "(0, 1] (0.25, 1.0), integers are token counts (512)")
    p.add_argument("--correction", default="auto", choices=("auto", "none", "hajek"),
                   help="Hájek correction of randomized designs; auto: hajek unless the score "
                   "is random or keyformer, none for top-k")
    p.add_argument("--allocator", default="uniform", choices=("uniform", "adakv", "pyramidkv"),
                   help="how the budget is spread over heads (adakv) and layers (pyramidkv)")
    p.add_argument("--schedule", default="oneshot",
                   help="'oneshot' (compress once after prefill), 'decode:K' (evict every "
                   "K decode steps), or 'step' / 'step:permanent' (per-step designs: a fresh "
                   "sample at every decode step, score perstep)")
    p.add_argument("--mixture", type=float, default=None,
                   help="defensive mixture weight in [0, 1] of poisson/fixed designs "
                   "(default 0)")
    p.add_argument("--floor", type=float, default=None,
                   help="lower bound on every tail pi of poisson/fixed designs, in [0, 1) "
                        "(default 0)")
    from tracesim.policies.cli_grid import add_design_options

    add_design_options(p)
    p.add_argument("--window", type=int, default=None,
                   help="recent-window length in tokens for every score (default: each "
                   "score's own)")
    p.add_argument("--summary-page", type=_csv(int), default=[0], metavar="P",
                   help="page sizes in positions (comma-separated, swept) of the summaries "
                   "kept for the tokens a policy does not keep, which give the deterministic "
                   "bound (columns bound2, bound_cov, summary_tokens); 0 = none (default 0)")
    p.add_argument("--seeds", type=int, default=32, help="number of seeds (default 32)")
    p.add_argument("--layers", type=_csv(int), default=None, help="layers (default: all)")
    p.add_argument("--sequences", type=_csv(str), default=None,
                   help="sequence ids (default: all)")
    p.add_argument("--per-seed", action="store_true", help="one row per seed (small runs)")
    p.add_argument("--precision", choices=("float64", "float32"), default="float64",
                   help="value GEMMs in float64 (reference, default) or float32")
    p.add_argument("--satterthwaite", action="store_true",
                   help="also compute tr(V^2) for the vector-level event (slow)")
    p.add_argument("--bootstrap", type=int, default=0, metavar="B",
                   help="Poisson-bootstrap replicates per certified row (columns boot_cov, "
                   "boot_cert2; about B times the estimate's cost); 0 = off (default 0)")
    p.add_argument("--no-output-space", action="store_true",
                   help="skip the per-layer output-space (GQA) certificate and error")
    p.add_argument("--threads", type=int, default=None,
                   help="numba threads (default: numba's, one per core)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--skip-damaged", action="store_true",
                   help="skip sequences that fail verification (default: stop with exit 2)")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=run_replay)


#: Columns the printed summary averages per configuration.
SUMMARY_MEANS = ("err2", "rel_err", "cert2", "wald_cov", "wald_t_cov", "kept_tokens",
                 "nominal_tokens", "evicted_mass")
#: Columns the printed summary reads.
SUMMARY_COLUMNS = ("config_id", "score", "design", "correction", "budget", *SUMMARY_MEANS,
                   "n_seeds", "sequence_id")


def summary_table(batches: pa.Table | Iterable[pa.RecordBatch], policies: list | None = None,
                  ) -> str:
    """Mean error, certificate and coverage per policy, as aligned text; with ``policies``, a
    last column names each per-step score's proxy and whether it is deployable
    (``quant:4 (deployable)``, ``exact (not deployable)``) and marks the oracle.

    ``batches`` (a table, or record batches read part by part) are aggregated one batch at a
    time: sums and counts per configuration, never the whole table."""
    from tracesim.policies.cli_grid import proxy_label

    labels = {p.id: proxy_label(p.score) for p in policies or ()}
    if isinstance(batches, pa.Table):
        batches = batches.to_batches()
    # per configuration, in order of first appearance: its first row's labels, then sums and
    # counts of the non-null values of each mean column (null = not applicable)
    acc: dict[str, dict] = {}
    for batch in batches:
        if batch.num_rows == 0:
            continue
        enc = pc.dictionary_encode(batch.column("config_id"))
        idx = enc.indices.to_numpy(zero_copy_only=False)
        cids = enc.dictionary.to_pylist()
        n = len(cids)
        first = np.full(n, batch.num_rows)
        np.minimum.at(first, idx, np.arange(batch.num_rows))
        for j, cid in enumerate(cids):
            if cid not in acc:
                row = {k: batch.column(k)[int(first[j])].as_py()
                       for k in ("score", "design", "correction", "budget")}
                acc[cid] = {"row": row, "sum": dict.fromkeys(SUMMARY_MEANS, 0.0),
                            "n": dict.fromkeys(SUMMARY_MEANS, 0), "n_seeds_max": 0}
        for k in SUMMARY_MEANS:
            col = batch.column(k)
            valid = col.is_valid().to_numpy(zero_copy_only=False)
            vals = pc.fill_null(pc.cast(col, pa.float64()), 0.0).to_numpy(zero_copy_only=False)
            sums = np.bincount(idx[valid], weights=vals[valid], minlength=n)
            counts = np.bincount(idx[valid], minlength=n)
            for j, cid in enumerate(cids):
                acc[cid]["sum"][k] += float(sums[j])
                acc[cid]["n"][k] += int(counts[j])
        seeds_max = np.zeros(n, dtype=np.int64)
        np.maximum.at(seeds_max, idx, pc.fill_null(batch.column("n_seeds"), 0)
                      .to_numpy(zero_copy_only=False).astype(np.int64))
        for j, cid in enumerate(cids):
            acc[cid]["n_seeds_max"] = max(acc[cid]["n_seeds_max"], int(seeds_max[j]))
    rows = []
    for cid, a in acc.items():
        row = dict(a["row"], proxy=labels.get(cid, ""), n_seeds_max=a["n_seeds_max"],
                   err2_count=a["n"]["err2"])
        row.update({f"{k}_mean": a["sum"][k] / a["n"][k] if a["n"][k] else None
                    for k in SUMMARY_MEANS})
        rows.append(row)
    rows.sort(key=lambda r: (r["score"], r["budget"] is None, r["budget"] or 0.0, r["design"]))
    head = (f"{'score':<10} {'design':<9} {'corr':<5} {'budget':>6} {'kept':>7} {'err2':>10} "
            f"{'rel_err':>8} {'cert2':>10} {'wald':>6} {'wald_t':>6} {'evict':>6} "
            f"{'seeds':>5} {'rows':>6}" + ("  proxy" if any(labels.values()) else ""))
    lines = [head, "-" * len(head)]

    def num(v, fmt):
        width = int(fmt.split(".")[0])
        if v is None or (isinstance(v, float) and np.isnan(v)):
            return "-".rjust(width)
        return format(v, fmt)

    for r in rows:
        lines.append(
            f"{r['score']:<10} {r['design']:<9} {r['correction']:<5} "
            f"{num(r['budget'], '6.3g')} {num(r['kept_tokens_mean'], '7.1f')} "
            f"{num(r['err2_mean'], '10.4g')} {num(r['rel_err_mean'], '8.3f')} "
            f"{num(r['cert2_mean'], '10.4g')} {num(r['wald_cov_mean'], '6.3f')} "
            f"{num(r['wald_t_cov_mean'], '6.3f')} {num(r['evicted_mass_mean'], '6.3f')} "
            f"{r['n_seeds_max']:>5} {r['err2_count']:>6}"
            + (f"  {r['proxy']}" if any(labels.values()) else ""))
    return "\n".join(lines)


def build_policies(args: argparse.Namespace) -> list:
    """The grid the arguments describe, expanded by the sweep spec's grid parser
    (:func:`tracesim.policies.cli_grid.policies_from_options`); configurations a design makes
    identical are merged and left-out combinations noted on stderr."""
    from tracesim.policies.cli_grid import policies_from_options

    if args.floor is not None and not 0.0 <= args.floor < 1.0:
        raise ValueError(f"--floor = {args.floor}: expected a value in [0, 1)")
    for page in args.summary_page:
        if page < 0:
            raise ValueError(f"--summary-page {page}: expected a page size >= 1 (positions per "
                             f"page) or 0 for no summaries")
    policies, notes = policies_from_options(args)
    for note in notes:
        print(f"tracesim replay: note: {note}", file=sys.stderr)
    return policies


def per_step_note(policies: list) -> list[str]:
    """One line per per-step score configuration: every parameter it ran with (the defaults
    included: proxy ``exact`` is a reference, not deployable) and each design's mixture."""
    from tracesim.policies.cli_grid import proxy_label

    lines: dict[str, None] = {}
    for p in policies:
        if not getattr(p.score, "per_step", False):
            continue
        shown = ", ".join(f"{k} {v}" for k, v in p.score.params().items() if k != "proxy")
        design = ", ".join(f"{k} {v}" for k, v in json.loads(p.design.params_json()).items()
                           if k in ("mixture", "floor"))
        lines.setdefault(f"per-step score: proxy {proxy_label(p.score)}, {shown}; design "
                         f"{p.design.name}{' (' + design + ')' if design else ''}")
    return list(lines)


def _check_args(args: argparse.Namespace) -> Path:
    """Every argument check that needs no file: raise UsageError before anything is opened."""
    from tracesim.counts import (
        BOOTSTRAP_REPLICATES,
        LAYER_INDEX,
        LAYERS,
        SEEDS,
        SEQUENCES,
        SUMMARY_PAGE,
    )
    from tracesim.errors import UsageError, check_int, check_out_dir, check_threads
    from tracesim.policies.grid import parse_schedule

    SEEDS.check(args.seeds, "--seeds")
    if args.layers is not None:
        LAYERS.check_items(args.layers, "--layers")
        for i, layer in enumerate(args.layers):
            LAYER_INDEX.check(layer, f"--layers[{i}]")
    if args.sequences is not None:
        SEQUENCES.check_items(args.sequences, "--sequences")
    SUMMARY_PAGE.check_items(args.summary_page, "--summary-page")
    for page in args.summary_page:
        SUMMARY_PAGE.check(page, "--summary-page")
    try:  # the sweep grammar's one bound on K of decode:K
        parse_schedule(args.schedule, "--schedule")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    check_threads(args.threads)
    if args.window is not None:
        check_int(args.window, "--window", 0)
    BOOTSTRAP_REPLICATES.check(args.bootstrap, "--bootstrap")
    if args.bootstrap == 1:
        raise UsageError("--bootstrap: 1 is not a number of bootstrap replicates, expected 0 "
                         "(off) or at least 2")
    from tracesim.outpaths import check_output

    check_output(args.out, [("trace store", args.traces)])
    out = check_out_dir(args.out)
    results = out / "results"
    if results.is_symlink() or (results.exists() and not results.is_dir()):
        raise UsageError(f"--out {out}: results is not a directory, expected the results "
                         "dataset directory (or nothing)")
    from tracesim.atomic import check_file_targets

    check_file_targets(out, list(LEGACY_FILES))  # removed once the new results are in
    return out


#: The single files earlier versions wrote; removed once the results dataset that replaces
#: them is published (a reader would otherwise find two results in one directory).
LEGACY_FILES = ("replay.parquet", "configs.json", "summary.json")


#: Largest ``--seeds`` (each seed is one replay of every randomized policy).
MAX_SEEDS = 100_000  # == tracesim.counts.SEEDS.hi


def run_replay(args: argparse.Namespace) -> int:
    """Run the ``replay`` subcommand; return an exit code.

    Arguments are checked before anything is opened; the output directory is locked for the
    run; the results are the dataset ``OUT/results`` (one part per sequence, written as it
    finishes, with ``manifest.json``, ``summary.json`` and ``configs.json``;
    :mod:`tracesim.dataset`), swapped in as one unit once complete: a failed run leaves the
    previous results as they were, and a rerun of the same command resumes its parts.
    """
    from tracesim.atomic import DirLock, remove_stale_tmp
    from tracesim.store import StoreError, open_store

    try:
        out = _check_args(args)
        policies = build_policies(args)
        store = open_store(args.traces, require_rows=True)
    except (ValueError, StoreError) as exc:
        print(f"tracesim replay: {exc}", file=sys.stderr)
        return 2
    from tracesim.policies.redundancy import budget_warnings

    for line in per_step_note(policies):  # the defaults ran too: say which
        print(f"tracesim replay: {line}", file=sys.stderr)
    lengths = store.manifest.column("prompt_length").to_pylist()
    for message in budget_warnings(policies, lengths or None):
        print(f"tracesim replay: warning: {message}", file=sys.stderr)
    if args.threads:
        import numba

        numba.set_num_threads(args.threads)
    out.mkdir(parents=True, exist_ok=True)
    lock = DirLock(out, "replay")
    try:
        remove_stale_tmp(out)
        return _replay_locked(args, out, policies, store)
    finally:
        lock.release()


def _replay_locked(args: argparse.Namespace, out: Path, policies: list, store) -> int:
    from dataclasses import asdict

    from tracesim.digests import prereg_record
    from tracesim.replay import ReplayOptions
    from tracesim.replay.results import store_identity, write_replay_dataset
    from tracesim.version import __version__

    options = ReplayOptions(output_space=not args.no_output_space,
                            satterthwaite=args.satterthwaite, precision=args.precision,
                            bootstrap=args.bootstrap)
    # hashed before any result is written: a prereg that cannot be read (a FIFO, a /proc
    # file) fails the run while the earlier outputs are still the earlier run's
    prereg_doc = prereg_record(None, args.traces)
    # what the rows depend on: a rerun with the same inputs resumes, anything else restarts
    run_doc = {"tool": "replay", "version": __version__, "store": store_identity(store),
               "policies": [p.id for p in policies], "seeds": args.seeds,
               "layers": args.layers, "sequences": args.sequences, "per_seed": args.per_seed,
               "options": asdict(options)}
    t0 = time.perf_counter()
    skipped: list[str] = []
    configs = json.dumps([json.loads(p.to_json()) | {"id": p.id} for p in policies], indent=1)

    def summary_doc(record: dict) -> dict:
        return {"store": str(args.traces), "policies": len(policies), "seeds": args.seeds,
                "wall_time_s": time.perf_counter() - t0, "skipped_damaged": skipped,
                "prereg": prereg_doc, **record}

    try:
        n_rows, resumed = write_replay_dataset(
            out, store, policies, seeds=args.seeds, layers=args.layers,
            sequences=args.sequences, per_seed=args.per_seed, options=options,
            run_doc=run_doc, summary_doc=summary_doc,
            extra_files={"configs.json": configs.encode()}, progress=not args.no_progress,
            skip_damaged=getattr(args, "skip_damaged", False), skipped=skipped)
    except ValueError as exc:
        print(f"tracesim replay: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - t0
    for name in LEGACY_FILES:  # superseded by results/ (written by an earlier version)
        (out / name).unlink(missing_ok=True)
    for msg in skipped:
        print(f"tracesim replay: skipped damaged sequence: {msg}", file=sys.stderr)
    if resumed:
        print(f"tracesim replay: resumed: {resumed} part(s) of an interrupted run of the same "
              "command were kept", file=sys.stderr)
    import pyarrow.parquet as pq

    from tracesim.dataset_read import dataset_parts

    results = out / "results"
    sequences: set[str] = set()

    def batches():  # part by part, one record batch at a time
        for path in dataset_parts(results):
            with pq.ParquetFile(path) as f:
                for batch in f.iter_batches(columns=list(SUMMARY_COLUMNS)):
                    sequences.update(pc.unique(batch.column("sequence_id")).to_pylist())
                    yield batch

    print(summary_table(batches(), policies))
    print(f"\n{n_rows} rows ({len(policies)} policies, {len(sequences)} sequence(s), "
          f"{args.seeds} seeds) in {elapsed:.1f} s -> {results}/ (parts/, manifest.json)")
    return 0
