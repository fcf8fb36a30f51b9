"""Build the report: evaluate every pre-registered claim, apply Holm, write Markdown and HTML.

``tracesim report RESULTS OUTCOMES --out report/`` reads the replay/sweep results, the in-loop
outcomes and (optionally) the C0 adversary demo, checks that ``data/prereg.yaml`` is the file the
results were produced under, and writes ``report.md``, a standalone ``report.html`` (figures
embedded as PNG), ``claims.json`` and the figures as PNG files.
"""

from __future__ import annotations

import base64
import html
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from analysis import figures
from analysis.claims import INCONCLUSIVE, SUPPORTED, ClaimResult, claims_table
from analysis.claims_c8 import evaluate_c8
from analysis.claims_outcomes import evaluate_c2_accuracy, evaluate_c3, evaluate_c4, evaluate_c6
from analysis.claims_replay import (
    evaluate_c0,
    evaluate_c1,
    evaluate_c2_attention,
    evaluate_c5,
    evaluate_c7,
    recompute_curves,
)
from analysis.multiplicity import holm
from analysis.prereg import Preregistration, check_prereg_hash, load_prereg

__all__ = ["Report", "build_report", "load_results"]

_RESULT_FILES = ("results/results.parquet", "results.parquet", "replay.parquet")


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def load_results(directory: str | Path) -> tuple[pd.DataFrame, dict[str, Any] | None]:
    """The replay results table and its summary from a sweep or replay output directory."""
    d = Path(directory)
    for name in _RESULT_FILES:
        if (d / name).is_file():
            path = d / name
            summary = _read_json(path.parent / "summary.json")
            return pq.read_table(path).to_pandas(), summary
    raise ValueError(f"{d}: no results file found (expected one of {list(_RESULT_FILES)})")


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
                 frontier_dir: str | Path | None = None) -> Report:
    """Evaluate every claim of the pre-registration on the given results.

    ``frontier_dir`` (default ``RESULTS/frontier`` when present) is a ``tracesim frontier``
    output: its tables and figure are included, and its ``validity_rules.json`` is used for C8
    after checking it was fit on calibration sequences only (``ValidityRuleError`` if not).
    """
    prereg = load_prereg(prereg_path)
    results = summary_r = outcomes = summary_o = None
    if results_dir is not None:
        results, summary_r = load_results(results_dir)
    if outcomes_dir is not None:
        path = Path(outcomes_dir) / "outcomes.parquet"
        if not path.is_file():
            raise ValueError(f"{outcomes_dir}: no outcomes.parquet")
        outcomes = pq.read_table(path).to_pandas()
        summary_o = _read_json(Path(outcomes_dir) / "summary.json")
    matches = True
    for name, summary in (("results", summary_r), ("outcomes", summary_o)):
        if summary is not None or (name == "results" and results is not None):
            matches &= check_prereg_hash(prereg, _recorded_hash(summary),
                                         allow_change=allow_prereg_change)
    report = Report(claims=[], prereg=prereg, prereg_matches=matches)
    if not matches:
        report.notes.append("WARNING: the pre-registration changed after these results were "
                            "produced; reported anyway because --allow-prereg-change was given.")
    adversary = None
    for d in (adversary_dir, results_dir):
        if d is not None and (Path(d) / "adversary.json").is_file():
            adversary = _read_json(Path(d) / "adversary.json")
            break
    claims: dict[str, ClaimResult] = {"C0": evaluate_c0(adversary, prereg)}
    empty = pd.DataFrame()
    res_df = results if results is not None else empty
    out_df = outcomes if outcomes is not None else empty
    if not res_df.empty:
        # First: a validity rule fitted on held-out sequences stops the report before any work.
        claims["C8"] = _c8(res_df, prereg, results_dir, frontier_dir, report)
        c1, strata = evaluate_c1(res_df, prereg)
        claims["C1"] = c1
        if strata:
            report.figures["coverage"] = figures.coverage_figure(
                strata, float(prereg.claims["C1"]["nominal"]))
            report.tables["coverage strata"] = "\n\n".join(
                f"by {k}\n{v.summary()}" for k, v in strata.items())
        claims["C2"] = evaluate_c2_attention(res_df, prereg)
        claims["C5"] = evaluate_c5(res_df, prereg)
        logprobs = _logprobs(traces_dir) if traces_dir else None
        curves = recompute_curves(res_df, logprobs, (0.05, 0.1, 0.2))
        claims["C7"] = evaluate_c7(curves, prereg)
        report.figures["error_vs_budget"] = figures.error_budget_figure(res_df)
        report.figures["head_budgets"] = figures.head_budget_figure(res_df)
        if not curves.empty:
            report.figures["recompute"] = figures.recompute_figure(curves)
    else:
        for cid in ("C1", "C2", "C5", "C7", "C8"):
            claims[cid] = ClaimResult(cid, prereg.claims[cid]["hypothesis"],
                                      detail="no replay results given")
    if not out_df.empty:
        extra = evaluate_c2_accuracy(out_df, 0.05, prereg.claim_alpha("C2"))
        claims["C2"].extra.update(extra)
        if extra:
            claims["C2"].detail += (f"; end to end: accuracy difference "
                                    f"{extra['accuracy_difference']:+.3f} over "
                                    f"{extra['accuracy_pairs']} pairs, TOST p = "
                                    f"{extra['accuracy_tost_p']:.3g}")
        claims["C3"] = evaluate_c3(out_df, prereg)
        c4, roc4 = evaluate_c4(out_df, prereg)
        c6, roc6 = evaluate_c6(out_df, prereg)
        claims["C4"], claims["C6"] = c4, c6
        if roc4 or roc6:
            report.figures["roc"] = figures.roc_figure({**roc4, **roc6})
        cols = dict(accuracy=("correct", "mean"), full_cache=("full_correct", "mean"),
                    runs=("correct", "size"))
        if "kept_fraction" in out_df:
            cols["kept_fraction"] = ("kept_fraction", "mean")
        acc = out_df.groupby(["score", "design", "correction", "budget"], dropna=False).agg(**cols)
        report.tables["end-to-end accuracy"] = acc.round(3).to_string()
    else:
        for cid in ("C3", "C4", "C6"):
            claims[cid] = ClaimResult(cid, prereg.claims[cid]["hypothesis"],
                                      detail="no in-loop outcomes given")
    report.claims = [claims[c] for c in sorted(claims)]
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


def _c8(res_df: pd.DataFrame, prereg: Preregistration, results_dir, frontier_dir,
        report: Report) -> ClaimResult:
    """C8 with the frontier's rules when given (checked), else rules fitted here; include the
    frontier's Markdown and figure in the report."""
    from analysis.validity import load_rules

    fdir = Path(frontier_dir) if frontier_dir is not None else (
        Path(results_dir) / "frontier" if results_dir is not None else None)
    rules = None
    if fdir is not None and (fdir / "validity_rules.json").is_file():
        rules = load_rules(fdir / "validity_rules.json")
    c8, _ = evaluate_c8(res_df, prereg, rules)
    if rules is not None:
        c8.detail += f"; rules from {fdir.name}/validity_rules.json"
    if fdir is not None and (fdir / "frontier.md").is_file():
        report.sections["certificate frontier"] = (fdir / "frontier.md").read_text()
        if (fdir / "frontier.png").is_file():
            report.figures["frontier"] = (fdir / "frontier.png").read_bytes()
    return c8


def _logprobs(traces_dir: str | Path) -> dict[str, np.ndarray]:
    from tracesim.store import open_store

    store = open_store(traces_dir)
    m = store.manifest.select(["sequence_id", "generated_logprobs"]).to_pylist()
    return {r["sequence_id"]: np.asarray(r["generated_logprobs"], dtype=float) for r in m}


def write_report(report: Report, out: str | Path) -> Path:
    """Write report.md, report.html, claims.json and the PNG figures; return the HTML path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, png in report.figures.items():
        (out / f"{name}.png").write_bytes(png)
    rows = claims_table(report.claims)
    md = ["# tracesim report", "",
          f"Pre-registration: `{report.prereg.path.name}` ({report.prereg.sha256[:19]}…), "
          f"Holm across claims at α = {report.prereg.alpha}.", ""]
    md += [f"> {n}" for n in report.notes]
    md += ["## Claims", "", "| " + " | ".join(rows[0]) + " |",
           "|" + "---|" * len(rows[0])]
    md += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    md += [""]
    for c in report.claims:
        md += [f"### {c.claim}: {c.verdict}", "", f"*{c.hypothesis}*", "", c.detail, ""]
    for title, text in report.tables.items():
        md += [f"## {title}", "", "```", text, "```", ""]
    for title, text in report.sections.items():
        md += [f"## {title}", "", text.replace("\n# ", "\n### ").replace("\n## ", "\n### "),
               ""]
    for name in report.figures:
        md += [f"![{name}]({name}.png)", ""]
    (out / "report.md").write_text("\n".join(md))
    (out / "claims.json").write_text(json.dumps(
        [asdict(c) for c in report.claims], indent=1, default=float))
    name = html.escape(str(report.prereg.path.name))
    body = [f"<h1>tracesim report</h1><p>Pre-registration <code>{name}</code> "
            f"({report.prereg.sha256[:19]}…), Holm at α = {report.prereg.alpha}.</p>"]
    body += [f"<p class='warn'>{html.escape(n)}</p>" for n in report.notes]
    body.append("<h2>Claims</h2><table><tr>" + "".join(f"<th>{html.escape(h)}</th>"
                                                        for h in rows[0]) + "</tr>")
    for r in rows[1:]:
        cls = r[-1].replace(" ", "-")
        body.append("<tr>" + "".join(f"<td>{html.escape(x)}</td>" for x in r[:-1])
                    + f"<td class='{cls}'>{html.escape(r[-1])}</td></tr>")
    body.append("</table>")
    for c in report.claims:
        body.append(f"<h3>{c.claim}: {html.escape(c.verdict)}</h3><p><em>"
                    f"{html.escape(c.hypothesis)}</em></p><p>{html.escape(c.detail)}</p>")
    for title, text in {**report.tables, **report.sections}.items():
        body.append(f"<h2>{html.escape(title)}</h2><pre>{html.escape(text)}</pre>")
    for name, png in report.figures.items():
        data = base64.b64encode(png).decode()
        body.append(f"<h2>{html.escape(name)}</h2><img alt='{name}' "
                    f"src='data:image/png;base64,{data}'/>")
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:"
             "collapse}td,th{border:1px solid #ccc;padding:.3em .6em}.supported{color:#070}"
             ".not-supported{color:#a00}.inconclusive{color:#a60}.warn{color:#a00}"
             "img{max-width:100%}pre{background:#f6f6f6;padding:.5em}")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>tracesim report</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>")
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
