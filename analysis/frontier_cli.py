"""``tracesim frontier RESULTS --out DIR``: frontier.parquet, frontier.md, frontier.png.

Also writes ``DIR/validity_rules.json`` (the rules fitted on the pre-registered calibration
split, which ``tracesim report --frontier DIR`` checks and uses for claim C8). Every file is
written to a temporary sibling and renamed, so a reader never sees a half-written one.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tracesim.analysis.aggregate import ResultsDataset
from tracesim.analysis.frontier import (
    AIM,
    OPTIONAL_COLUMNS,
    REQUIRED_COLUMNS,
    STRATA,
    aim_table,
)
from tracesim.analysis.validity import (
    SplitSettings,
    ValidityRule,
    load_rules,
    save_rules,
)

from tracesim.atomic import atomic_files

__all__ = ["FILES", "load_frontier_results", "pareto_figure", "perstep_costs_markdown", "register",
           "render_markdown", "run_frontier"]

FILES = ("frontier.parquet", "frontier.md", "frontier.png", "validity_rules.json")
_DEFAULT_PREREG = Path(__file__).resolve().parents[1] / "data" / "prereg.yaml"
def load_frontier_results(path: str | Path) -> pd.DataFrame:
    """Read only the columns the frontier needs from a sweep/replay output (or a file)."""
    from tracesim.analysis.frontier_stream import results_file

    p = results_file(path)
    if p.name == "manifest.json":
        return _load_frontier_dataset(p)
    names = pq.read_schema(p).names
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise ValueError(f"{p}: results lack the columns {missing}")
    cols = [c for c in (*REQUIRED_COLUMNS, *OPTIONAL_COLUMNS) if c in names]
    schema = pq.read_schema(p)
    strings = [c for c in cols if pa.types.is_string(schema.field(c).type)]
    # Dictionary-encoded strings become pandas categoricals: millions of per-seed rows of a
    # few dozen configurations stay small in memory.
    from tracesim.integrity import KEY_COLUMNS, verify_results

    summary_path = p.parent / "summary.json"
    summary = None
    if summary_path.is_file() or summary_path.is_symlink():
        from tracesim.safeio import read_json

        summary = read_json(summary_path, "results summary")
    # the key columns too, so duplicated rows are refused (then dropped again)
    keys = [c for c in KEY_COLUMNS if c in names and c not in cols]
    table = pq.read_table(p, columns=cols + keys, read_dictionary=strings)
    # a results file given alone (no signed summary) is described as it is, with a note
    for note in verify_results(p, table, summary if isinstance(summary, dict) else None,
                               summary_path, configs=p.parent / "configs.json",
                               trust_unsigned=True, required={}):
        print(f"tracesim frontier: note: {note}", file=sys.stderr)
    df = table.drop_columns(keys).to_pandas()
    for c in strings:
        if c not in ("sequence_id", "config_id"):
            df[c] = df[c].astype(str)
    return df


def _load_frontier_dataset(manifest: Path) -> pd.DataFrame:
    """The frontier's columns of a sweep's results dataset, verified part by part."""
    from tracesim.analysis.results_io import read_verified

    from tracesim.dataset_read import dataset_columns

    names = dataset_columns(manifest.parent)
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise ValueError(f"{manifest}: results lack the columns {missing}")
    cols = [c for c in (*REQUIRED_COLUMNS, *OPTIONAL_COLUMNS) if c in names]
    notes: list[str] = []
    table, _ = read_verified(manifest, trust_unsigned=True, notes=notes, columns=cols,
                             required={})
    for note in notes:
        print(f"tracesim frontier: note: {note}", file=sys.stderr)
    # as the single-file path: strings kept as categoricals except the free-text columns
    table = pa.table({c: (pc.dictionary_encode(table[c])
                          if pa.types.is_string(table[c].type) else table[c])
                      for c in table.column_names})
    df = table.to_pandas()
    for c in cols:
        if pa.types.is_dictionary(table[c].type) and c not in ("sequence_id", "config_id"):
            df[c] = df[c].astype(str)
    return df


def pareto_figure(table: pd.DataFrame) -> bytes:
    """Memory vs mean err2 (left) and vs coverage (right), one line per family over budgets.

    Non-deployable families (oracle) are drawn dashed with hollow markers.
    """
    from tracesim.analysis.plotting import png_bytes, pyplot

    plt = pyplot()
    t = table[table["stratum_kind"] == "all"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    err = t.drop_duplicates(["family", "budget"]).sort_values("memory")
    cmap = plt.get_cmap("tab20")
    fams = sorted(err["family"].unique())
    color = {f: cmap(i % 20) for i, f in enumerate(fams)}
    for fam, g in err.groupby("family"):
        dep = bool(g["deployable"].iloc[0])
        axes[0].plot(g["memory"], g["err2"], ls="-" if dep else "--", marker="o",
                     mfc=None if dep else "none", color=color[fam],
                     label=fam + ("" if dep else " (not deployable)"))
    axes[0].set_yscale("log")
    axes[0].set_xlabel("memory (kept + summary tokens per KV head)")
    axes[0].set_ylabel("mean squared error |ô - o|²")
    axes[0].set_title("error vs memory")
    marks = {"wald": "o", "wald_t": "^", "ruled": "s", "bound": "D", "bootstrap": "v"}
    cov = t[t["variant"].isin(list(marks))].sort_values("memory")
    for (fam, var), g in cov.groupby(["family", "variant"]):
        dep = bool(g["deployable"].iloc[0])
        axes[1].errorbar(g["memory"], g["coverage"], yerr=[g["coverage"] - g["ci_low"],
                                                           g["ci_high"] - g["coverage"]],
                         ls="-" if dep else "--", marker=marks[var], capsize=2,
                         mfc=None if dep else "none", color=color[fam], alpha=0.8)
    lo, hi = AIM["coverage"]
    axes[1].axhspan(lo, hi, color="0.85", zorder=0, label=f"aim [{lo}, {hi}]")
    for var, mk in marks.items():
        if var in set(cov["variant"]):
            axes[1].plot([], [], marker=mk, ls="", color="k", label=var)
    axes[1].set_xlabel("memory (kept + summary tokens per KV head)")
    axes[1].set_ylabel("coverage (cluster-robust 95% CI)")
    axes[1].set_title("coverage vs memory")
    axes[1].legend(fontsize=7, loc="lower right")
    axes[0].legend(fontsize=6, loc="upper right", ncol=1)
    return png_bytes(fig)


def _f(x: Any, d: int = 3) -> str:
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return "—"
    return f"{x:.{d}g}" if isinstance(x, float) else str(x)


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(r) + " |" for r in rows])


def render_markdown(table: pd.DataFrame, notes: list[str],
                    rules: dict[str, ValidityRule]) -> str:
    """frontier.md: the overall table, the aim check, the validity rules and the strata."""
    t = table[table["stratum_kind"] == "all"]
    md = ["# Certificate frontier", "",
          "Coverage with cluster-robust 95% intervals (clusters = sequences). `ruled` = primary "
          "Wald on held-out sequences, rows the validity rule certifies. Memory = kept + "
          "summary tokens per KV head. `err/top-k` = mean err2 over top-k's at equal memory "
          "(same score, interpolated). Tightness = sqrt(bound2/err2), median / p90. "
          "`*` = not deployable (reference).", ""]
    md += [f"> {n}" for n in notes] + ([""] if notes else [])
    rows = []
    for r in t.itertuples(index=False):
        rows.append([r.family + ("" if r.deployable else " *"), _f(r.budget), r.variant,
                     "—" if pd.isna(r.coverage) else
                     f"{r.coverage:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}]",
                     _f(r.frac_certified), str(int(r.n_sequences)), _f(r.memory, 4),
                     _f(r.rel_err), _f(r.err2), _f(r.err_vs_topk),
                     "—" if pd.isna(r.tightness_median)
                     else f"{r.tightness_median:.3g} / {r.tightness_p90:.3g}"])
    md += _md_table(["family", "budget", "variant", "coverage [95% CI]", "certified", "seqs",
                     "memory", "rel err", "err2", "err/top-k", "tightness"], rows) + [""]
    aim = aim_table(table)
    md += ["## Aim at 25% budget", "",
           f"Held-out `ruled` coverage in [{AIM['coverage'][0]}, {AIM['coverage'][1]}], "
           f"≥ {AIM['certified']:.0%} of rows certified, err/top-k ≤ {AIM['err_vs_topk']}, "
           "deployable.", ""]
    if aim.empty:
        md += ["No `ruled` rows at budget 0.25.", ""]
    else:
        md += _md_table(["family", "coverage [95% CI]", "certified", "err/top-k", "met"], [
            [r.family + ("" if r.deployable else " *"),
             f"{r.coverage:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}]", _f(r.frac_certified),
             _f(r.err_vs_topk), "yes" if r.aim_met else "no"] for r in aim.itertuples()]) + [""]
    if rules:
        md += ["## Validity rules (fitted on the calibration sequences)", ""]
        md += _md_table(["config", "rule", "calib. coverage", "calib. certified", "reached"], [
            [f"`{k}`".replace("|", "\\|"), r.describe(), _f(r.calibration_coverage),
             _f(r.calibration_certified), "yes" if r.reached else "no"]
            for k, r in rules.items()]) + [""]
    for kind in STRATA:
        s = table[(table["stratum_kind"] == kind) & table["variant"].isin(["wald", "ruled"])]
        if s.empty:
            continue
        piv = s.pivot_table(index=["family", "budget", "variant"], columns="stratum",
                            values="coverage", aggfunc="first", sort=False)
        n = s.pivot_table(index=["family", "budget", "variant"], columns="stratum",
                          values="n_rows", aggfunc="first", sort=False)
        cols = list(dict.fromkeys(s["stratum"]))
        md += [f"## Coverage by {kind}", "", "coverage (rows)", ""]
        md += _md_table(["family", "budget", "variant", *cols], [
            [str(i[0]), _f(i[1]), str(i[2])] + [
                "—" if pd.isna(piv.loc[i].get(c)) else
                f"{piv.loc[i][c]:.3f} ({int(n.loc[i][c])})" for c in cols]
            for i in piv.index]) + [""]
    return "\n".join(md)


def _head_dim(results: str | Path) -> int:
    """The stores' head dimension from the results' ``summary.json`` (64 when not recorded)."""
    from tracesim.analysis.provenance import _store_model

    from tracesim.safeio import read_json

    p = Path(results)
    for summary in ([p / "results" / "summary.json", p / "summary.json"] if p.is_dir()
                    else [p.parent / "summary.json"]):
        if not summary.is_file():
            continue
        try:
            doc = read_json(summary, "results summary.json", limit=16 << 20)
        except (OSError, ValueError):
            return 64
        stores = [s.get("path") for s in doc.get("stores", []) if isinstance(s, dict)]
        for store in [*stores, doc.get("store")]:
            model = _store_model(store) if isinstance(store, str) else None
            if model and model.get("head_dim"):
                return int(model["head_dim"])
    return 64


def perstep_costs_markdown(results: pd.DataFrame | ResultsDataset, head_dim: int = 64) -> str:
    """frontier.md's section on per-step designs (empty without per-step rows): error and Wald
    coverage of every configuration next to the HBM it holds and the bytes attention reads per
    layer and step (:mod:`tracesim.analysis.perstep_costs`), prefill designs alongside. The
    frontier's
    memory axis (kept + summary tokens) does not describe a design that reads the whole cache
    from a lower tier, so they are tabulated against these two costs instead. Computed from
    per-configuration sums (:mod:`tracesim.analysis.perstep_stream`), never the rows."""
    from tracesim.analysis.perstep_stream import perstep_costs_table

    ds = (results if isinstance(results, ResultsDataset)
          else ResultsDataset.from_frame(results))
    needed = ("schedule", "kv_head", "n_positions", "sinks", "window")
    if any(c not in ds for c in needed) or ds.empty or ds.query(
            "SELECT count(*) AS n FROM results WHERE \"schedule\" = 'step'")["n"].iloc[0] == 0:
        return ""
    t = perstep_costs_table(ds, head_dim)
    rows = [[r.score, r.proxy, r.design, r.schedule, _f(r.budget), _f(r.wald), _f(r.mse, 4),
             _f(r.hbm_kib, 5), _f(r.step_read_kib, 5), _f(r.read_rows, 6)]
            for r in t.itertuples(index=False)]
    md = ["", "## Per-step designs: error and coverage against HBM and bytes per step", "",
          "Per layer and decode step, summed over KV heads (fp16 K/V and the tiers memory "
          "model's defaults; docs/perstep.md, Costs). Bytes read include a per-step design's "
          "proxy summary of every cached token.", ""]
    md += _md_table(["score", "proxy", "design", "schedule", "budget", "Wald", "MSE",
                     "HBM KiB", "read KiB / step", "rows from the lower tier"], rows)
    return "\n".join(md) + "\n"


def run_frontier(results: str | Path, out: str | Path, *,
                 prereg_path: str | Path = _DEFAULT_PREREG, rules_path: str | Path | None = None,
                 alpha: float = 0.05) -> tuple[pd.DataFrame, list[str]]:
    """Compute the frontier of a results directory and write the files of :data:`FILES`."""
    from tracesim.analysis.frontier_stream import open_frontier_results, stream_frontier
    from tracesim.analysis.prereg import load_prereg

    from tracesim.outpaths import check_output

    # before anything is computed: the output must not overlap what is read
    out = check_output(out, [("results", results), ("validity rules file", rules_path),
                             ("pre-registration file", prereg_path)])
    if out.is_dir():  # a directory in the way of one of the files: refuse before the work
        from tracesim.atomic import check_file_targets

        check_file_targets(out, list(FILES))
    # the rules file is read first: a bad --rules fails before the results are read
    given = load_rules(rules_path) if rules_path is not None else None
    # verified and opened, never loaded whole: one family's rows at a time
    # (tracesim.analysis.frontier_stream)
    ds = open_frontier_results(results)
    try:
        prereg = load_prereg(prereg_path)
        settings = SplitSettings.from_claim(prereg.claims["C8"])
        table, notes, rules = stream_frontier(ds, settings, given, alpha)
        perstep_md = perstep_costs_markdown(ds, _head_dim(results))
    finally:
        ds.close()
    out.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pandas(table, preserve_index=False), buf)
    with atomic_files(out, list(FILES)) as stage:  # the four files or none of them
        (stage / "frontier.parquet").write_bytes(buf.getvalue())
        (stage / "frontier.md").write_bytes((render_markdown(table, notes, rules)
                                             + perstep_md).encode())
        (stage / "frontier.png").write_bytes(pareto_figure(table))
        save_rules(stage / "validity_rules.json", rules, settings)
    return table, notes


def _command(args: argparse.Namespace) -> int:
    from tracesim.analysis.prereg import PreregChangedError
    from tracesim.analysis.validity import ValidityRuleError

    from tracesim.counts import check_finite

    try:
        check_finite(args.alpha, "--alpha", 0.0, 1.0, open_lo=True)
        if args.alpha >= 1:
            raise ValueError(f"--alpha {args.alpha}: expected a level in (0, 1)")
        table, notes = run_frontier(args.results, args.out, prereg_path=args.prereg,
                                    rules_path=args.rules, alpha=args.alpha)
    except (ValidityRuleError, PreregChangedError, ValueError) as exc:
        print(f"tracesim frontier: {exc}", file=sys.stderr)
        return 2
    for n in notes:
        print(n)
    t = table[table["stratum_kind"] == "all"]
    print(f"{t['family'].nunique()} families, {len(t)} (family, budget, variant) rows; "
          f"wrote {', '.join(FILES)} to {args.out}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tracesim frontier``."""
    p = subparsers.add_parser(
        "frontier", help="coverage / certified share / error / memory frontier per policy and "
                         "certificate variant (frontier.parquet, .md, .png)",
        description="Per score x design x budget x certificate variant (wald, wald_t, ruled "
                    "by the validity rule on held-out sequences, bound, bootstrap when the "
                    "results carry them): coverage overall and by stratum with cluster-robust "
                    "intervals, fraction certified, error relative to top-k at equal memory, "
                    "bound tightness; fits the validity rules on the pre-registered "
                    "calibration split. See docs/calibration.md.",
        epilog="example:\n  tracesim frontier results/calibration/main --out "
               "results/calibration/frontier-main")
    p.add_argument("results", help="sweep or replay output directory (or a results .parquet)")
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--prereg", default=str(_DEFAULT_PREREG),
                   help="pre-registration with claim C8's split (default data/prereg.yaml)")
    p.add_argument("--rules", default=None,
                   help="use these fitted rules (validity_rules.json) instead of fitting; "
                        "refused if fit on held-out sequences (default: fit)")
    p.add_argument("--alpha", type=float, default=0.05,
                   help="level of the cluster-robust intervals (default 0.05)")
    p.set_defaults(func=_command)
