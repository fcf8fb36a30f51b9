"""Build the report: evaluate every pre-registered claim, apply Holm, write Markdown and HTML.

``tracesim report RESULTS OUTCOMES --out report/`` reads the replay/sweep results, the in-loop
outcomes and (optionally) the C0 adversary demo, checks that ``data/prereg.yaml`` is the file the
results were produced under, and writes ``report.md``, a standalone ``report.html`` (figures
embedded as PNG), ``claims.json`` and the figures as PNG files. The report opens with a
provenance header and a caveat computed from the number of sequences
(:mod:`tracesim.analysis.provenance`); the claims table carries each hypothesis and the units of its
estimate; every figure has a caption. The claims evaluated are those of the claims table
(:mod:`tracesim.analysis.claim_registry`); this module only loads their inputs, applies Holm and
presents the results; the parts beside the claims are drawn by
:mod:`tracesim.analysis.report_parts` and the files written by
:mod:`tracesim.analysis.report_write`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from tracesim.analysis.aggregate import open_results
from tracesim.analysis.claim_registry import claims_table, registered_claims
from tracesim.analysis.claims import (
    INCONCLUSIVE,
    INPUT_MISSING,
    SUPPORTED,
    ClaimInputs,
    ClaimResult,
)
from tracesim.analysis.fetch import split_fetch_outcomes
from tracesim.analysis.multiplicity import holm
from tracesim.analysis.perstep_figure import add_to_report as add_perstep_frontier
from tracesim.analysis.prereg import Preregistration, check_prereg_hash, load_prereg
from tracesim.analysis.provenance import Provenance, collect_provenance, summary_head_dim
from tracesim.analysis.report_inputs import (
    ResultsInput,
    describe_input,
    open_further_results,
    recorded_prereg_hash,
)
from tracesim.analysis.report_parts import (
    PEERS_TABLE,
    PERSTEP_TABLE,
    add_fetch,
    add_outcome_parts,
    add_replay_parts,
    add_tiers,
    has_perstep,
    peers_table,
)
from tracesim.analysis.report_write import write_report
from tracesim.analysis.results_io import (
    _read_json,
    load_outcomes,
    load_peers,
    load_results,
)
from tracesim.analysis.verify_inputs import check_adversary, verify_traces

from tracesim.errors import UsageError
from tracesim.plugins import provenance
from tracesim.registry import CLAIM_REGISTRY

__all__ = ["Report", "build_report", "load_results", "write_report"]


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
                 trust_unsigned: bool = False, scheduler: str | None = None,
                 more_results: Sequence[str | Path] = ()) -> Report:
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

    ``more_results`` are further results directories (``--results``), verified as
    ``results_dir`` is (:mod:`tracesim.analysis.report_inputs`) and drawn in a per-step
    section each; they are descriptive: the claims read ``results_dir`` only.
    """
    prereg = load_prereg(prereg_path)
    if traces_dir is not None:
        verify_traces(traces_dir)  # before any claim reads it
    results = summary_r = outcomes = summary_o = None
    load_notes: list[str] = []
    inputs_r: list[ResultsInput] = []
    if more_results and results_dir is None:
        raise UsageError("--results DIR adds descriptive results beside RESULTS: give RESULTS "
                         "(the results the claims read) first")
    if results_dir is not None:
        # verified part by part, never read whole: each claim, table and figure asks DuckDB
        # for its aggregates or its own rows (tracesim.analysis.aggregate)
        results = open_results(results_dir, trust_unsigned=trust_unsigned, notes=load_notes,
                               scheduler=scheduler)
        summary_r = results.summary
        inputs_r = [describe_input(results_dir, results)]
        inputs_r += open_further_results(
            more_results, inputs_r[0], prereg=prereg, allow_prereg_change=allow_prereg_change,
            trust_unsigned=trust_unsigned, scheduler=scheduler, notes=load_notes)
    if outcomes_dir is not None:
        outcomes, summary_o = load_outcomes(outcomes_dir, trust_unsigned=trust_unsigned,
                                            notes=load_notes)
    peers = load_peers(peers_dirs) if peers_dirs else pd.DataFrame()
    matches = True
    unrecorded = []
    for name, summary in (("results", summary_r), ("outcomes", summary_o)):
        if summary is not None or (name == "results" and results is not None):
            recorded = recorded_prereg_hash(summary)
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
        prereg_name=prereg.path.name, prereg_matches=matches, traces_dir=traces_dir,
        results_inputs=[(i.label, i.dataset.n_rows, i.sha256) for i in inputs_r])
    if len(inputs_r) > 1:
        report.notes.append(
            f"NOTE: the claims read RESULTS ({inputs_r[0].label}) only; the further results ("
            + ", ".join(i.label for i in inputs_r[1:]) + ") are descriptive: a per-step "
            "section each, no claim.")
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
        add_replay_parts(report, inputs, claims, fdir)
    if inputs.given("outcomes"):
        add_outcome_parts(report, inputs)
    head_dim = report.provenance.head_dim or 64
    for i, inp in enumerate(inputs_r):
        _add_perstep_section(report, inp, i, len(inputs_r) > 1,
                             head_dim if i == 0 else summary_head_dim(inp.dataset.summary)
                             or head_dim)
    if not peers.empty:
        report.tables[PEERS_TABLE] = peers_table(peers)
    if not fetch_df.empty:
        add_fetch(report, fetch_df, out_df)
    if tiers_dir is not None:
        add_tiers(report, tiers_dir)
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


def _add_perstep_section(report: Report, inp: ResultsInput, index: int, labelled: bool,
                         head_dim: int) -> None:
    """Input ``index``'s per-step table and figure (the first input's under the usual title),
    from per-configuration sums; a further input without per-step rows gets a note."""
    ds = inp.dataset
    if ds.empty or "score" not in ds or not has_perstep(ds):
        if index > 0:
            report.notes.append(f"NOTE: {inp.label} holds no per-step design's rows: no "
                                "per-step section for it.")
        return
    if index == 0:
        add_perstep_frontier(report, ds, head_dim, label=inp.label if labelled else "")
    else:
        add_perstep_frontier(report, ds, head_dim, title=f"{PERSTEP_TABLE}: {inp.label}",
                             figure=f"perstep_frontier_{index + 1}_{inp.slug}",
                             label=inp.label)


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
