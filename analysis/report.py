"""Build the report: evaluate every pre-registered claim, apply Holm, write Markdown and HTML.

``tracesim report RESULTS OUTCOMES --out report/`` reads the replay/sweep results, the in-loop
outcomes and (optionally) the C0 adversary demo, checks that ``data/prereg.yaml`` is the file the
results were produced under, and writes ``report.md``, a standalone ``report.html`` (figures
embedded as PNG), ``claims.json`` and the figures as PNG files. The report opens with a
provenance header and a caveat computed from the number of sequences
(:mod:`tracesim.analysis.provenance`); the claims table carries each hypothesis and the units of its
estimate; every figure has a caption. The claims evaluated are those of the claims table
(:mod:`tracesim.analysis.claim_registry`); this module only loads their inputs, applies Holm and
presents the results.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
from tracesim.analysis import figures
from tracesim.analysis import report_figures as rfig
from tracesim.analysis.aggregate import open_results
from tracesim.analysis.answer_span import add_to_report as add_answer_span
from tracesim.analysis.claim_registry import claims_table, registered_claims
from tracesim.analysis.claims import (
    INCONCLUSIVE,
    INPUT_MISSING,
    SUPPORTED,
    ClaimInputs,
    ClaimResult,
)
from tracesim.analysis.evict_perstep import add_to_report as add_perstep_outcomes
from tracesim.analysis.fetch import compare_fetch, fetch_figure, fetch_table, split_fetch_outcomes
from tracesim.analysis.multiplicity import holm
from tracesim.analysis.perstep_figure import add_to_report as add_perstep_frontier
from tracesim.analysis.prereg import Preregistration, check_prereg_hash, load_prereg
from tracesim.analysis.provenance import Provenance, collect_provenance
from tracesim.analysis.results_io import (
    _read_json,
    load_outcomes,
    load_peers,
    load_results,
)
from tracesim.analysis.verify_inputs import check_adversary, verify_traces

from tracesim.plugins import provenance
from tracesim.registry import CLAIM_REGISTRY

__all__ = ["Report", "build_report", "load_results", "write_report"]


def _recorded_hash(summary: dict[str, Any] | None) -> str | None:
    if not summary:
        return None
    pre = summary.get("prereg")
    return pre.get("sha256") if isinstance(pre, dict) else summary.get("prereg_sha256")


@dataclass
class Report:
    """Everything the report prints."""

    claims: list[ClaimResult]
    prereg: Preregistration
    prereg_matches: bool
    figures: dict[str, bytes] = field(default_factory=dict)
    tables: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    captions: dict[str, str] = field(default_factory=dict)
    provenance: Provenance | None = None

    def add_figure(self, name: str, made: tuple[bytes, str] | None) -> None:
        """Add a ``(png, caption)`` pair (``None``: nothing to draw)."""
        if made is not None:
            self.figures[name], self.captions[name] = made
    sections: dict[str, str] = field(default_factory=dict)  # raw Markdown (the frontier)

    def terminal_table(self) -> str:
        rows = claims_table(self.claims)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def build_report(results_dir: str | Path | None, outcomes_dir: str | Path | None, *,
                 prereg_path: str | Path, adversary_dir: str | Path | None = None,
                 traces_dir: str | Path | None = None,
                 allow_prereg_change: bool = False,
                 tiers_dir: str | Path | None = None,
                 frontier_dir: str | Path | None = None,
                 peers_dirs: Sequence[str | Path] = (),
                 trust_unsigned: bool = False, scheduler: str | None = None) -> Report:
    """Evaluate every claim of the claims table (:mod:`tracesim.analysis.claim_registry`) on the
    given
    results.

    ``frontier_dir`` (default ``RESULTS/frontier`` when present) is a ``tracesim frontier``
    output: its tables and figure are included, and its ``validity_rules.json`` is used for C8
    after checking it was fit on calibration sequences only (``ValidityRuleError`` if not).
    ``tiers_dir`` is a ``tracesim tiers`` output: C7 in bytes and modelled time.
    ``peers_dirs`` are ``tracesim peers`` outputs: C10 (vAttention's guarantee). Results are
    verified against their summary (:func:`load_results`); ``trust_unsigned`` accepts
    results whose summary records no hash, with a warning in the report. ``scheduler`` (a
    Dask scheduler) computes the results' aggregates with Dask instead of DuckDB
    (:class:`tracesim.analysis.aggregate.ResultsDataset`). A claim whose inputs
    are absent is listed as ``not evaluated`` with the input it lacks.
    """
    prereg = load_prereg(prereg_path)
    if traces_dir is not None:
        verify_traces(traces_dir)  # before any claim reads it
    results = summary_r = outcomes = summary_o = None
    load_notes: list[str] = []
    if results_dir is not None:
        # verified part by part, never read whole: each claim, table and figure asks DuckDB
        # for its aggregates or its own rows (tracesim.analysis.aggregate)
        results = open_results(results_dir, trust_unsigned=trust_unsigned, notes=load_notes,
                               scheduler=scheduler)
        summary_r = results.summary
    if outcomes_dir is not None:
        outcomes, summary_o = load_outcomes(outcomes_dir, trust_unsigned=trust_unsigned,
                                            notes=load_notes)
    peers = load_peers(peers_dirs) if peers_dirs else pd.DataFrame()
    matches = True
    unrecorded = []
    for name, summary in (("results", summary_r), ("outcomes", summary_o)):
        if summary is not None or (name == "results" and results is not None):
            recorded = _recorded_hash(summary)
            if recorded is None:  # nothing recorded is not a change: say what it is
                unrecorded.append(name)
                continue
            matches &= check_prereg_hash(prereg, recorded, allow_change=allow_prereg_change)
    report = Report(claims=[], prereg=prereg, prereg_matches=matches)
    report.notes += [f"WARNING: {n}" for n in load_notes]
    report.notes += [f"WARNING: the {name}' summary records no pre-registration (the command "
                     f"found no {PREREG_NAME} near its inputs or the working directory); the "
                     f"claims are evaluated against {prereg.path.name} as given, unverified"
                     for name in unrecorded]
    report.provenance = collect_provenance(
        results, summary_r, outcomes, summary_o, prereg_sha256=prereg.sha256,
        prereg_name=prereg.path.name, prereg_matches=matches, traces_dir=traces_dir)
    if not matches:
        report.notes.append("WARNING: the pre-registration changed after these results were "
                            "produced; reported anyway because --allow-prereg-change was given.")
    report.notes += [f"WARNING: {Path(d).name}/peers.parquet (C10) records no sha256 and no "
                     "pre-registration hash (written by a version of tracesim peers that did "
                     "not sign its table); it is read as given" for d in peers_dirs
                     if not (Path(d) / "results" / "manifest.json").is_file()]
    if results is not None and "model_id" in results:
        models = results.query("SELECT DISTINCT model_id FROM results WHERE model_id IS NOT "
                               "NULL ORDER BY model_id")["model_id"].tolist()
        if len(models) > 1:  # a claim's held-out set is one model's sequences
            report.notes.append(
                f"NOTE: the results hold rows of {len(models)} models ({', '.join(models)}); "
                "C11 reads only its model's rows, every other results claim pools them: give "
                "each model's results to a report of its own to read those claims per model.")
    adversary = None
    for d in (adversary_dir, results_dir):
        if d is not None and (Path(d) / "adversary.json").is_file():
            adversary = _read_json(Path(d) / "adversary.json")
            check_adversary(adversary, Path(d) / "adversary.json")
            break
    # In-loop fetch runs repeat every (policy, seed) once per fetch scheduler and budget: the
    # outcome claims read plain eviction only (no fetching, or the `none` scheduler).
    out_df, fetch_df = split_fetch_outcomes(outcomes if outcomes is not None else pd.DataFrame())
    fdir = Path(frontier_dir) if frontier_dir is not None else (
        Path(results_dir) / "frontier" if results_dir is not None else None)
    inputs = ClaimInputs(prereg=prereg,
                         results=results if results is not None else pd.DataFrame(),
                         outcomes=out_df, peers=peers, adversary=adversary,
                         traces_dir=Path(traces_dir) if traces_dir else None, frontier_dir=fdir)
    claims = _evaluate(inputs)
    if inputs.given("results"):
        _add_replay_parts(report, inputs, claims, fdir)
    if inputs.given("outcomes"):
        _add_outcome_parts(report, inputs)
    res = inputs.results
    if not res.empty and "score" in res and _has_perstep(res):
        add_perstep_frontier(report, res.read(PERSTEP_COLUMNS),
                             report.provenance.head_dim or 64)
    if not peers.empty:
        report.tables[PEERS_TABLE] = peers_table(peers)
    if not fetch_df.empty:
        _add_fetch(report, fetch_df, out_df)
    if tiers_dir is not None:
        _add_tiers(report, tiers_dir)
    report.claims = [claims[c] for c in sorted(claims, key=lambda c: int(c[1:]))]
    adjusted = holm({c.claim: c.pvalue for c in report.claims}, alpha=prereg.alpha)
    for c in report.claims:
        if c.claim in adjusted:
            c.adjusted_pvalue = adjusted[c.claim][0]
            # A test-based "supported" must survive the correction across claims.
            if c.verdict == SUPPORTED and c.adjusted_pvalue >= prereg.claim_alpha(c.claim):
                c.verdict = INCONCLUSIVE
                c.detail += (f"; significant alone (p = {c.pvalue:.3g}) but not after Holm "
                             f"(p = {c.adjusted_pvalue:.3g})")
    return report


PREREG_NAME = "data/prereg.yaml"

#: Tables printed first, right after the provenance: what the per-step designs measured, with
#: the prefill designs (in the same table) and the peers beside them.
PERSTEP_TABLE, PEERS_TABLE = "per-step designs", "peers on the same steps"
LEAD_TABLES = (PERSTEP_TABLE, PEERS_TABLE)


def peers_table(peers: pd.DataFrame) -> str:
    """One row per peer configuration: kept tokens, error, tracesim's Wald coverage on its
    samples and the rate at which its own bound held (``tracesim peers`` rows)."""
    wanted = {"kept": "kept_tokens", "mse": "err2", "wald": "wald_cov",
              "own_bound_held": "peer_bound_ok"}
    agg = peers.groupby("config_id", sort=False).agg(
        rows=("config_id", "size"),
        **{name: (col, "mean") for name, col in wanted.items() if col in peers})
    return agg.to_string(float_format=lambda x: f"{x:.4g}")


#: Columns the per-step table and figure read (:func:`tracesim.analysis.perstep.perstep_table`,
#: :func:`tracesim.analysis.perstep_costs.cost_columns`).
PERSTEP_COLUMNS = ("store", "config_id", "score", "score_params", "design", "budget",
                   "sequence_id", "wald_cov", "wald_t_cov", "err2", "kept_tokens",
                   "n_positions", "head", "kv_head", "sinks", "window")


def _has_perstep(results) -> bool:
    """Whether the results hold a per-step design's row (one row looked for)."""
    return bool(results.query("SELECT count(*) AS n FROM (SELECT 1 FROM results WHERE "
                              "\"score\" = 'perstep' LIMIT 1)")["n"].iloc[0])


def _figure_where() -> str:
    """SQL: the rows the calibration figures draw: certified, with a positive certificate and
    an error (``report_figures._certified``)."""
    from tracesim.analysis.aggregate import notna
    from tracesim.analysis.claims import certified_where

    return f"{certified_where()} AND {notna('err2')} AND \"cert2\" > 0"


def _certified_by_design(results) -> dict[str, rfig.CertifiedRows]:
    """:func:`report_figures.certified_rows` from the dataset: one design at a time, only its
    two float columns (16 bytes a row), the sequences counted in DuckDB."""
    from tracesim.analysis.aggregate import sql_in

    where = _figure_where()
    designs = results.query(f"SELECT design, COUNT(DISTINCT sequence_id) AS sequences FROM "
                            f"results WHERE {where} GROUP BY design ORDER BY design")
    out = {}
    for design, sequences in designs.itertuples(index=False):
        rows = results.read(["cert2", "err2"], f"{where} AND {sql_in('design', [design])}")
        out[str(design)] = rfig.CertifiedRows(rows["cert2"].to_numpy(float),
                                              rows["err2"].to_numpy(float), int(sequences))
    return out


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


def _evaluate(inputs: ClaimInputs) -> dict[str, ClaimResult]:
    """Every registered claim on ``inputs`` (those marked ``first`` before the others); a
    claim lacking an input it needs is ``not evaluated`` with the reason."""
    table = registered_claims()
    out: dict[str, ClaimResult] = {}
    for claim in sorted(table, key=lambda c: not c.first):
        lacking = [n for n in claim.needs if not inputs.given(n)]
        out[claim.id] = (ClaimResult(claim.id, inputs.hypothesis(claim.id),
                                     detail=INPUT_MISSING[lacking[0]]) if lacking
                         else claim.evaluate(inputs))
        if CLAIM_REGISTRY.is_plugin(claim.id):  # which code made the row (claims.json)
            out[claim.id].extra["plugin"] = provenance("claim", claim.id, as_loaded=True)
    return out


def _add_replay_parts(report: Report, inputs: ClaimInputs, claims: dict[str, ClaimResult],
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
    # The calibration figures read each design's two float columns once; the heatmap, error
    # and kept-token figures draw means, from DuckDB group-bys.
    by_design = _certified_by_design(res)
    report.add_figure("certificate_vs_error", rfig.certificate_error_figure(by_design))
    report.add_figure("coverage_vs_level", rfig.coverage_level_figure(
        by_design, report.provenance.head_dim))
    del by_design
    column = c1.extra.get("column", "wald_cov")
    report.add_figure("coverage_by_head", rfig.coverage_heatmap(
        None, column, nominal, cells=_heatmap_cells(res, column)))
    report.add_figure("error_vs_budget", (figures.error_budget_figure(res), _ERROR_CAPTION))
    report.add_figure("head_budgets", (figures.head_budget_figure(res), _HEADS_CAPTION))
    curves = inputs.artifacts.get("C7 curves")
    if curves is not None and not curves.empty:
        report.add_figure("recompute", (figures.recompute_figure(curves), _RECOMPUTE_CAPTION))


def _add_outcome_parts(report: Report, inputs: ClaimInputs) -> None:
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


def _add_fetch(report: Report, fetch: pd.DataFrame, plain: pd.DataFrame) -> None:
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


def _add_tiers(report: Report, tiers_dir: str | Path) -> None:
    """C7 in bytes and time: the ``tracesim tiers`` tables and figure."""
    from tracesim.analysis.tiers import scheduler_curves, tiers_figure, tiers_tables

    path = Path(tiers_dir) / "tiers.parquet"
    if not path.is_file():
        raise ValueError(f"--tiers {tiers_dir}: no tiers.parquet, expected a tracesim tiers "
                         "output directory")
    df = pq.read_table(path).to_pandas()
    curves_text, tests_text = tiers_tables(df)
    report.tables["tiered memory: error recovered per scheduler and fetch budget"] = curves_text
    report.tables["tiered memory: paired tests over sequences (Holm per scheduler)"] = tests_text
    report.add_figure("tiers", (tiers_figure(scheduler_curves(df)), _TIERS_CAPTION))


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


def _tier_class(tier: str) -> str:
    return "caveat-" + tier.replace("a ", "", 1).replace(" ", "-")


def write_report(report: Report, out: str | Path) -> Path:
    """Write report.md, report.html, claims.json and the PNG figures; return the HTML path.

    The output directory is locked while writing and every file appears complete or not at
    all (temp file, fsync, rename).
    """
    from tracesim.atomic import DirLock, atomic_write_bytes

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with DirLock(out, "report"):
        return _write_report(report, out, atomic_write_bytes)


def _write_report(report: Report, out: Path, write) -> Path:
    for name, png in report.figures.items():
        write(out / f"{name}.png", png, unique=True)
    rows = claims_table(report.claims, text=True)
    prov = report.provenance
    md = ["# tracesim report", ""]
    if prov is not None:
        md += [f"> **{prov.caveat}**", "", "| provenance | |", "|---|---|"]
        md += [f"| {k} | {v} |" for k, v in prov.rows]
        md += [""]
    md += [f"Pre-registration: `{report.prereg.path.name}` ({report.prereg.sha256[:19]}…), "
           f"Holm across claims at α = {report.prereg.alpha}.", ""]
    md += [f"> {n}" for n in report.notes]
    lead = {t: report.tables[t] for t in LEAD_TABLES if t in report.tables}
    rest = {t: v for t, v in report.tables.items() if t not in lead}
    for title, text in lead.items():
        md += [f"## {title}", "", "```", text, "```", ""]
    md += ["## Claims", "", "| " + " | ".join(rows[0]) + " |",
           "|" + "---|" * len(rows[0])]
    md += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    md += [""]
    for c in report.claims:
        md += [f"### {c.claim}: {c.verdict}", "", f"*{c.hypothesis}*", "", c.detail, ""]
    for title, text in rest.items():
        md += [f"## {title}", "", "```", text, "```", ""]
    for title, text in report.sections.items():
        md += [f"## {title}", "", text.replace("\n# ", "\n### ").replace("\n## ", "\n### "),
               ""]
    md += ["## Figures", ""]
    for i, name in enumerate(report.figures, 1):
        md += [f"![{name}]({name}.png)", "",
               f"*Figure {i} ({name}).* {report.captions.get(name, '')}", ""]
    write(out / "report.md", "\n".join(md).encode(), unique=True)
    write(out / "claims.json", json.dumps(
        [asdict(c) for c in report.claims], indent=1, default=float).encode(), unique=True)
    esc = html.escape
    name = esc(str(report.prereg.path.name))
    body = ["<h1>tracesim report</h1>"]
    if prov is not None:
        body.append(f"<p class='caveat {_tier_class(prov.tier)}'>{esc(prov.caveat)}</p>")
        body.append("<table class='prov'>" + "".join(
            f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in prov.rows) + "</table>")
    body.append(f"<p>Pre-registration <code>{name}</code> "
                f"({report.prereg.sha256[:19]}…), Holm at α = {report.prereg.alpha}.</p>")
    body += [f"<p class='warn'>{esc(n)}</p>" for n in report.notes]
    body += [f"<h2>{esc(title)}</h2><pre>{esc(text)}</pre>" for title, text in lead.items()]
    body.append("<h2>Claims</h2><table class='claims'><tr>" + "".join(
        f"<th>{esc(h)}</th>" for h in rows[0]) + "</tr>")
    for r in rows[1:]:
        cls = r[-1].replace(" ", "-")
        body.append("<tr>" + f"<td>{esc(r[0])}</td>" + f"<td class='text'>{esc(r[1])}</td>"
                    + f"<td class='unit'>{esc(r[2])}</td>"
                    + "".join(f"<td>{esc(x)}</td>" for x in r[3:-1])
                    + f"<td class='{cls}'>{esc(r[-1])}</td></tr>")
    body.append("</table>")
    for c in report.claims:
        body.append(f"<h3>{c.claim}: {esc(c.verdict)}</h3><p><em>"
                    f"{esc(c.hypothesis)}</em></p><p>{esc(c.detail)}</p>")
    for title, text in {**rest, **report.sections}.items():
        body.append(f"<h2>{esc(title)}</h2><pre>{esc(text)}</pre>")
    if report.figures:
        body.append("<h2>Figures</h2>")
    for i, (fig_name, png) in enumerate(report.figures.items(), 1):
        data = base64.b64encode(png).decode()
        body.append(f"<figure id='{esc(fig_name)}'><img alt='{esc(fig_name)}' "
                    f"src='data:image/png;base64,{data}'/><figcaption><b>Figure {i} "
                    f"({esc(fig_name)}).</b> {esc(report.captions.get(fig_name, ''))}"
                    "</figcaption></figure>")
    style = ("body{font-family:sans-serif;max-width:66em;margin:2em auto;line-height:1.4}"
             "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;"
             "padding:.3em .6em;vertical-align:top}th{text-align:left;background:#f3f3f3}"
             ".claims td.text{max-width:22em}.claims td.unit{max-width:16em;color:#444;"
             "font-size:90%}.supported{color:#070}.not-supported{color:#a00}"
             ".inconclusive{color:#a60}.warn{color:#a00}.caveat{padding:.6em 1em;"
             "border-left:6px solid #c60;background:#fff4e5;font-weight:bold}"
             ".caveat-study{border-color:#070;background:#eef8ee}"
             "figure{margin:1.5em 0;border-top:1px solid #ddd;padding-top:.8em}"
             "figcaption{font-size:92%;color:#333;max-width:60em}"
             "img{max-width:100%}pre{background:#f6f6f6;padding:.5em;overflow-x:auto}")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>tracesim report</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>")
    path = out / "report.html"
    write(path, page.encode("utf-8"), unique=True)
    return path
