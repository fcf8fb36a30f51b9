"""The report's figures and tables beside the claims: each ``add_*`` function draws one input's
part (the replay results, the in-loop outcomes, the frontier, fetches, tiers, peers) into a
:class:`tracesim.analysis.report.Report`, reading the results through DuckDB aggregates or
filtered reads of a few columns (:mod:`tracesim.analysis.aggregate`), never the whole table.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
from tracesim.analysis import figures
from tracesim.analysis import report_figures as rfig
from tracesim.analysis.answer_span import add_to_report as add_answer_span
from tracesim.analysis.calibration_stream import calibration_stats_of
from tracesim.analysis.claims import ClaimInputs, ClaimResult
from tracesim.analysis.evict_perstep import add_to_report as add_perstep_outcomes
from tracesim.analysis.fetch import compare_fetch, fetch_figure, fetch_table

if TYPE_CHECKING:
    from tracesim.analysis.report import Report

__all__ = ["LEAD_TABLES", "PEERS_TABLE", "PERSTEP_TABLE", "add_fetch", "add_outcome_parts",
           "add_replay_parts", "add_tiers", "has_perstep", "lead_tables", "peers_table"]


#: Tables printed first, right after the provenance: what the per-step designs measured, with
#: the prefill designs (in the same table) and the peers beside them.
PERSTEP_TABLE, PEERS_TABLE = "per-step designs", "peers on the same steps"
LEAD_TABLES = (PERSTEP_TABLE, PEERS_TABLE)


def lead_tables(titles: list[str]) -> list[str]:
    """The titles printed first, in order: the first results' per-step table, each further
    results input's (``per-step designs: DIR (sweep NAME)``, in the order given), the peers."""
    further = [t for t in titles if t.startswith(f"{PERSTEP_TABLE}: ")]
    return [t for t in (PERSTEP_TABLE, *further, PEERS_TABLE) if t in titles]


def peers_table(peers: pd.DataFrame) -> str:
    """One row per peer configuration: kept tokens, error, tracesim's Wald coverage on its
    samples and the rate at which its own bound held (``tracesim peers`` rows)."""
    wanted = {"kept": "kept_tokens", "mse": "err2", "wald": "wald_cov",
              "own_bound_held": "peer_bound_ok"}
    agg = peers.groupby("config_id", sort=False).agg(
        rows=("config_id", "size"),
        **{name: (col, "mean") for name, col in wanted.items() if col in peers})
    return agg.to_string(float_format=lambda x: f"{x:.4g}")


def has_perstep(results) -> bool:
    """Whether the results hold a per-step design's row (one row looked for)."""
    return bool(results.query("SELECT count(*) AS n FROM (SELECT 1 FROM results WHERE "
                              "\"score\" = 'perstep' LIMIT 1)")["n"].iloc[0])


def _figure_where() -> str:
    """SQL: the rows the calibration figures draw: certified, with a positive certificate and
    an error (``report_figures._certified``)."""
    from tracesim.analysis.aggregate import notna
    from tracesim.analysis.claims import certified_where

    return f"{certified_where()} AND {notna('err2')} AND \"cert2\" > 0"


def _heatmap_cells(results, column: str) -> pd.DataFrame:
    """:func:`report_figures.heatmap_cells` as one DuckDB group-by."""
    from tracesim.analysis.aggregate import notna, quote

    if column not in results:
        return pd.DataFrame(columns=["design", "layer", "head", "coverage", "sequences", "rows"])
    c = quote(column)
    return results.query(
        f"SELECT design, layer, head, AVG(CAST({c} AS DOUBLE)) AS coverage, "
        "COUNT(DISTINCT sequence_id) AS sequences, COUNT(*) AS rows FROM results "
        f"WHERE {_figure_where()} AND {notna(column)} GROUP BY design, layer, head "
        "ORDER BY design, layer, head")


def add_replay_parts(report: Report, inputs: ClaimInputs, claims: dict[str, ClaimResult],
                      fdir: Path | None) -> None:
    """The figures and tables of the replay results, in the order the report prints them: the
    frontier, C1's strata, the certificate and error figures, C7's recompute curves."""
    if fdir is not None:
        _add_frontier(report, fdir)
    prereg, res, c1 = inputs.prereg, inputs.results, claims["C1"]
    nominal = float(prereg.claims["C1"]["nominal"])
    strata = inputs.artifacts.get("C1 strata")
    if strata:
        report.add_figure("coverage", (figures.coverage_figure(strata, nominal),
                                       _COVERAGE_CAPTION.format(
            column=c1.extra.get("column", "?"), nominal=prereg.claims["C1"]["nominal"])))
        report.tables["coverage strata"] = "\n\n".join(
            f"by {k}\n{v.summary()}" for k, v in strata.items())
    # The calibration figures draw counts and order statistics of each design's certified
    # rows (one pass and four DuckDB sorts, never the rows in memory); the heatmap, error and
    # kept-token figures draw means, from DuckDB group-bys.
    calibration = calibration_stats_of(res, _figure_where())
    report.add_figure("certificate_vs_error", rfig.certificate_error_figure(calibration))
    report.add_figure("coverage_vs_level", rfig.coverage_level_figure(
        calibration, report.provenance.head_dim))
    column = c1.extra.get("column", "wald_cov")
    report.add_figure("coverage_by_head", rfig.coverage_heatmap(
        None, column, nominal, cells=_heatmap_cells(res, column)))
    report.add_figure("error_vs_budget", (figures.error_budget_figure(res), _ERROR_CAPTION))
    report.add_figure("head_budgets", (figures.head_budget_figure(res), _HEADS_CAPTION))
    curves = inputs.artifacts.get("C7 curves")
    if curves is not None and not curves.empty:
        report.add_figure("recompute", (figures.recompute_figure(curves), _RECOMPUTE_CAPTION))


def add_outcome_parts(report: Report, inputs: ClaimInputs) -> None:
    """The figures and the accuracy table of the in-loop outcomes (C4 and C6's ROC curves), and
    the per-step designs' outcome table, C2/C3/C6 and accuracy-bytes figure when there are any."""
    out_df = inputs.outcomes
    roc4, roc6 = inputs.artifacts.get("C4 roc", {}), inputs.artifacts.get("C6 roc", {})
    if roc4 or roc6:
        report.add_figure("roc", (figures.roc_figure({**roc4, **roc6}), _ROC_CAPTION))
    report.add_figure("accuracy_vs_budget", rfig.accuracy_budget_figure(out_df))
    cols = dict(accuracy=("correct", "mean"), full_cache=("full_correct", "mean"),
                runs=("correct", "size"))
    if "kept_fraction" in out_df:
        cols["kept_fraction"] = ("kept_fraction", "mean")
    acc = out_df.groupby(["score", "design", "correction", "budget"], dropna=False).agg(**cols)
    report.tables["end-to-end accuracy"] = acc.round(3).to_string()
    add_answer_span(report, out_df)
    add_perstep_outcomes(report, out_df, inputs.prereg)


def _add_frontier(report: Report, fdir: Path) -> None:
    """The ``tracesim frontier`` output's Markdown and figure, when it has them."""
    if (fdir / "frontier.md").is_file():
        from tracesim.safeio import read_bytes, read_text

        # bounded reads: a frontier directory may come from someone else
        report.sections["certificate frontier"] = read_text(fdir / "frontier.md", 16 << 20,
                                                            "frontier table")
        if (fdir / "frontier.png").is_file():
            report.add_figure("frontier", (read_bytes(fdir / "frontier.png", 64 << 20,
                                                      "frontier figure"), _FRONTIER_CAPTION))


_FRONTIER_CAPTION = (
    "The certificate frontier (tracesim frontier): memory against error and against coverage per "
    "score, design and budget; the table in the 'certificate frontier' section gives the "
    "values with cluster-robust intervals.")


def add_fetch(report: Report, fetch: pd.DataFrame, plain: pd.DataFrame) -> None:
    """In-loop fetches: accuracy against bytes, and paired tests against ``random``."""
    table = fetch_table(fetch)
    report.tables["in-loop fetches: accuracy and bytes per scheduler and budget"] = \
        table.round(4).to_string(index=False)
    tests = []
    for s in ("certificate_bound", "certificate_page", "certificate", "bound"):
        t = compare_fetch(fetch, s, ("random",))
        if not t.empty:
            t.insert(0, "scheduler", s)
            tests.append(t)
    if tests:
        report.tables["in-loop fetches: paired tests over sequences against random"] = (
            pd.concat(tests).to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    full = plain.loc[plain["score"] == "full", "correct"] if "score" in plain else plain.iloc[:0]
    report.add_figure("fetch", (fetch_figure(table, float(full.mean()) if len(full) else None),
                                _FETCH_CAPTION))


_FETCH_CAPTION = (
    "In-loop fetches (tracesim evict --fetch): end-to-end accuracy against the bytes moved, as "
    "a share of refetching every evicted page at every decode step and layer; the dotted line "
    "is the full cache. The oracle (dashed) reads the true attention and is not deployable.")


def add_tiers(report: Report, tiers_dir: str | Path) -> None:
    """C7 in bytes and time: the ``tracesim tiers`` tables and figure."""
    from tracesim.analysis.tiers import curves_tables, read_scheduler_curves, tiers_figure

    path = Path(tiers_dir) / "tiers.parquet"
    if not path.is_file():
        raise ValueError(f"--tiers {tiers_dir}: no tiers.parquet, expected a tracesim tiers "
                         "output directory")
    # the per-sequence curves aggregated by DuckDB from the columns they need, never the rows
    curves = read_scheduler_curves(path)
    curves_text, tests_text = curves_tables(curves)
    report.tables["tiered memory: error recovered per scheduler and fetch budget"] = curves_text
    report.tables["tiered memory: paired tests over sequences (Holm per scheduler)"] = tests_text
    report.add_figure("tiers", (tiers_figure(curves), _TIERS_CAPTION))


_TIERS_CAPTION = (
    "C7 in bytes and time (tracesim tiers): share of the eviction error left after each "
    "scheduler's fetches, against the bytes moved (as a share of refetching every evicted "
    "page) and against the modelled stall per sequence. The oracle (dashed) reads the true "
    "attention and is not deployable.")
_COVERAGE_CAPTION = (
    "Claim C1: empirical coverage of the primary event ({column}) per stratum — realised tail "
    "size m, Kish effective sample size, oracle sampled-out attention mass — with 95% "
    "cluster-robust intervals (GEE, sequences as clusters); the dashed line is the nominal "
    "{nominal}. Wide intervals mean few sequences, not poor calibration.")
_ERROR_CAPTION = (
    "Mean relative attention error |ô − o| / |o| of the head outputs against the budget "
    "(fraction of the context; token-count budgets are not drawn), one line per score / "
    "design, log scale. Designs that ignore the score (bernoulli, mixture 1) give the same "
    "rows for every score and are drawn once, as 'design (any score)'.")
_HEADS_CAPTION = (
    "Mean kept tokens per (layer, KV head) for each allocator, every evicting configuration "
    "pooled. One colour scale from 0 for all panels, so a uniform allocation reads as a flat "
    "colour and Ada-KV / PyramidKV differences are comparable across panels.")
_RECOMPUTE_CAPTION = (
    "Claim C7: share of the squared attention error recovered by recomputing a share of "
    "(decode step, head) units, chosen by the certificate, at random, or by lowest token "
    "log-prob, against the recompute budget (means over configurations and sequences).")
_ROC_CAPTION = (
    "Claims C4 and C6: ROC curves of the failure and attribution signals (AUC in the "
    "legend). Runs of one sequence are dependent; intervals and tests are in the claims "
    "table (cluster bootstrap over sequences).")


