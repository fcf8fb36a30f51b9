"""Write a built report: ``report.md``, a standalone ``report.html`` (figures embedded as
PNG), ``claims.json`` and the figures as PNG files, each complete or absent (temp file, fsync,
rename) under a lock on the output directory.
"""

from __future__ import annotations

import base64
import html
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from tracesim.analysis.claim_registry import claims_table
from tracesim.analysis.report_parts import lead_tables

if TYPE_CHECKING:
    from tracesim.analysis.report import Report

__all__ = ["write_report"]


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
    lead = {t: report.tables[t] for t in lead_tables(list(report.tables))}
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
