"""``tracesim frontier``'s reader: the frontier and its validity rules one family at a time.

The frontier's rows are groups of one family (a configuration without its budget) and its
budgets; a validity rule is fitted on one configuration's certified calibration rows. So the
results are never loaded whole: :func:`open_frontier_results` verifies them and opens a
:class:`~tracesim.analysis.aggregate.ResultsDataset`; the family labels come from the distinct
family columns (one row per configuration, a DuckDB group-by); then each family's rows (its
configurations, only the frontier's columns) are read, its rules fitted and its frontier rows
computed by the same code as the in-memory :func:`tracesim.analysis.frontier.frontier_table`.
Several families are read at once up to :data:`CHUNK_ROWS` rows (a larger family alone), in
one pass: memory is one read's rows, not the table's. The per-step section is computed from sums
(:mod:`tracesim.analysis.perstep_stream`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
from tracesim.analysis.aggregate import ResultsDataset, quote, sql_in
from tracesim.analysis.claims import certified_where
from tracesim.analysis.frontier import (
    _FAMILY,
    OPTIONAL_COLUMNS,
    REQUIRED_COLUMNS,
    STRATA,
    family_labels,
    finish_frontier,
    frontier_rows,
)
from tracesim.analysis.validity import (
    SplitSettings,
    ValidityRule,
    as_text,
    check_rules,
    fit_notes,
    fit_rule,
    split_sequences,
)

__all__ = ["RESULT_FILES", "open_frontier_results", "results_file", "stream_frontier"]

RESULT_FILES = ("results/manifest.json", "manifest.json", "results/results.parquet",
                "results.parquet", "replay.parquet")
_NOT_FULL = "\"score\" IS DISTINCT FROM 'full'"


def _note(text: str) -> None:
    print(f"tracesim frontier: note: {text}", file=sys.stderr)


def results_file(path: str | Path) -> Path:
    """The results file of a sweep/replay output directory (the first of
    :data:`RESULT_FILES` it holds), or ``path`` itself if it is a file."""
    p = Path(path)
    if p.is_dir():
        found = [p / n for n in RESULT_FILES if (p / n).is_file()]
        if not found:
            raise ValueError(f"{p}: no results file found (expected one of "
                             f"{list(RESULT_FILES)})")
        p = found[0]
    if not p.is_file():
        raise ValueError(f"{p}: no such results file")
    return p


def open_frontier_results(path: str | Path) -> ResultsDataset:
    """A sweep/replay output (or one results file) verified and opened, unread: a dataset part
    by part, a single file by its key columns; a results file given alone (no signed summary)
    is described as it is, with a note."""
    from tracesim.analysis.results_io import _configs_path, _read_json

    from tracesim.dataset_read import verify_dataset
    from tracesim.integrity import KEY_COLUMNS, verify_results

    p = results_file(path)
    summary_path = p.parent / "summary.json"
    if p.name == "manifest.json":
        summary = _read_json(summary_path)
        files, notes = verify_dataset(p.parent, summary, summary_path,
                                      configs=_configs_path(p), trust_unsigned=True,
                                      required={})
        names = pq.read_schema(files[0]).names if files else []
    else:
        from tracesim.safeio import read_json

        summary = (read_json(summary_path, "results summary")
                   if summary_path.is_file() or summary_path.is_symlink() else None)
        names = pq.read_schema(p).names
        # the key columns only: duplicated rows are refused without reading the rest
        keys = [c for c in dict.fromkeys((*KEY_COLUMNS, "config_id")) if c in names]
        table = pq.read_table(p, columns=keys)
        notes = verify_results(p, table, summary if isinstance(summary, dict) else None,
                               summary_path, configs=p.parent / "configs.json",
                               trust_unsigned=True, required={})
        del table
        files = [p]
    for note in notes:
        _note(note)
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise ValueError(f"{p}: results lack the columns {missing}")
    n_rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    return ResultsDataset(files=list(files), summary=summary if isinstance(summary, dict)
                          else None, columns=tuple(names), n_rows=n_rows)


def _families(ds: ResultsDataset) -> tuple[dict[str, str], dict[str, list[str]]]:
    """``config_id -> family label`` (as :func:`family_labels` of the whole table labels it)
    and the configurations of each family, from one row per configuration."""
    keys = [c for c in _FAMILY if c in ds]
    first = ds.query(f"SELECT {', '.join(map(quote, ['config_id', *keys]))} FROM results "
                     f"WHERE {_NOT_FULL} QUALIFY row_number() OVER (PARTITION BY "
                     "\"config_id\" ORDER BY __row) = 1 ORDER BY __row")
    if first.empty:
        return {}, {}
    labels = family_labels(first[keys])
    families = dict(zip(first["config_id"].astype(str), labels.astype(str), strict=True))
    members: dict[str, list[str]] = {}
    for cid, fam in families.items():
        members.setdefault(fam, []).append(cid)
    return families, members


def _read_family(ds: ResultsDataset, columns: list[str], ids: list[str],
                 where: str | None = None) -> pd.DataFrame:
    """The rows of these configurations, the frontier's columns, in the table's order (the
    identifiers as categoricals, as the whole-table reader gave them)."""
    df = ds.read(columns, " AND ".join([sql_in("config_id", ids), *([where] if where else [])]))
    for c in ("sequence_id", "config_id"):
        if c in df:
            df[c] = df[c].astype("category")
    return df


def _fit_rows(cert: pd.DataFrame, settings: SplitSettings, rules: dict[str, ValidityRule],
              failed: list[str]) -> None:
    """:func:`tracesim.analysis.validity.fit_rules`' loop on some configurations' rows:
    their rules into ``rules``, the ids no rule fits into ``failed``."""
    keep = cert["certified"].astype(bool) & cert["cert2"].notna()
    for cid, g in cert[keep].groupby("config_id", sort=True, observed=True):
        try:
            rules[str(cid)] = fit_rule(g, settings, str(cid))
        except ValueError:
            failed.append(str(cid))


def _fit_notes(ds: ResultsDataset, rules: dict[str, ValidityRule], failed: list[str]
               ) -> tuple[dict[str, ValidityRule], list[str]]:
    """The rules and :func:`fit_rules`' notes, in the order the whole-table reader grouped the
    configurations (categoricals in the order of their first row)."""
    order = {cid: i for i, cid in enumerate(ds.query(
        "SELECT CAST(\"config_id\" AS VARCHAR) AS c FROM results QUALIFY row_number() OVER "
        "(PARTITION BY \"config_id\" ORDER BY __row) = 1 ORDER BY __row")["c"])}
    failed = sorted(failed, key=order.__getitem__)
    notes = fit_notes(failed, "max_tail_weight" in ds)
    return dict(sorted(rules.items(), key=lambda kv: order[kv[0]])), notes


def _chunks(ds: ResultsDataset, members: dict[str, list[str]], limit: int) -> list[list[str]]:
    """The families in label order, packed into reads of at most ``limit`` rows (a larger
    family is one read of its own): fewer scans of the parts, memory still bounded."""
    counts = ds.sums(["config_id"], where=_NOT_FULL)
    per_config = dict(zip(counts["config_id"].astype(str), counts["rows"], strict=True))
    out: list[list[str]] = []
    size = 0
    for fam in sorted(members):
        n = sum(int(per_config.get(c, 0)) for c in members[fam])
        if not out or size + n > limit:
            out.append([])
            size = 0
        out[-1].append(fam)
        size += n
    return out


#: Rows read at once by the frontier (several families per read up to this; a larger family
#: alone): memory ~1 KB a row while its frontier rows are computed.
CHUNK_ROWS = 1 << 18
#: A rule set that holds no configuration of a family: the family's rows when the results
#: hold rules, all for other configurations (the ``ruled`` variant then certifies none).
_OTHERS_ONLY: dict[str, Any] = {"\x00": None}


def stream_frontier(ds: ResultsDataset, settings: SplitSettings,
                    given: dict[str, ValidityRule] | None, alpha: float,
                    chunk_rows: int | None = None
                    ) -> tuple[pd.DataFrame, list[str], dict[str, ValidityRule]]:
    """(frontier table, notes, rules) as :func:`tracesim.analysis.frontier_cli.run_frontier`
    computes them from the whole table, reading a few families' rows at a time (one pass:
    each family's rules are fitted on its own rows, then its frontier rows computed)."""
    columns = [c for c in (*REQUIRED_COLUMNS, *OPTIONAL_COLUMNS) if c in ds]
    seqs = ds.query("SELECT DISTINCT CAST(\"sequence_id\" AS VARCHAR) AS s FROM results "
                    "WHERE \"sequence_id\" IS NOT NULL")["s"]
    split = split_sequences(seqs, settings.salt, settings.fraction)
    held = [s for s, c in split.items() if not c]
    notes = [f"validity rules: split salt `{settings.salt}`, calibration fraction "
             f"{settings.fraction}: {len(split) - len(held)} calibration, {len(held)} held-out "
             f"sequences"]
    families, members = _families(ds)
    if given is not None:
        check_rules(given, settings, held)
    kinds = [k for k in STRATA if k != "store" or (
        "store" in ds and ds.query(f"SELECT count(DISTINCT \"store\") AS n FROM results "
                                   f"WHERE {_NOT_FULL}")["n"].iloc[0] > 1)]
    fitted: dict[str, ValidityRule] = {}
    failed: list[str] = []
    # per family: its rows with the rules it has, or (without a rule of its own) with none at
    # all and with others' only; which applies is known once every family is fitted
    parts: list[tuple[list, list, list | None, list | None]] = []

    def rows_of(chunk: pd.DataFrame, rules: dict | None) -> tuple[list, list[str]]:
        return frontier_rows(chunk, rules=rules or None, salt=settings.salt,
                             fraction=settings.fraction, alpha=alpha, families=families,
                             kinds=kinds)

    for fams in _chunks(ds, members, chunk_rows or CHUNK_ROWS):
        df = _read_family(ds, columns, [c for f in fams for c in members[f]], _NOT_FULL)
        if given is None:
            _fit_rows(df, settings, fitted, failed)
        labels = as_text(df["config_id"]).map(families)
        for fam in fams:
            chunk = df[(labels == fam).to_numpy()]
            own = given if given is not None else {
                c: fitted[c] for c in members[fam] if c in fitted}
            if own:
                parts.append((*rows_of(chunk, own), None, None))
            else:
                parts.append((*rows_of(chunk, None), *rows_of(chunk, _OTHERS_ONLY)))
        del df, labels
    if given is None:
        full = ds.query("SELECT DISTINCT CAST(\"config_id\" AS VARCHAR) AS c FROM results "
                        "WHERE \"score\" = 'full'")["c"].tolist()
        if full:
            _fit_rows(_read_family(ds, columns, full, certified_where()), settings, fitted,
                      failed)
        rules, fit_notes = _fit_notes(ds, fitted, failed)
        notes += fit_notes
        check_rules(rules, settings, held)
    else:
        rules = given
    if "n_seeds" in ds and ds.query("SELECT count(*) AS n FROM results WHERE "
                                    "\"n_seeds\" > 1")["n"].iloc[0] > 0:
        notes.append("aggregated rows: m and n_eff are seed means; fit rules on per-seed rows")
    rows: list[dict[str, Any]] = []
    table_notes: list[str] | None = None
    for out, more, others_out, others_more in parts:
        if others_out is not None and rules:
            out, more = others_out, others_more
        rows += out
        table_notes = more
    if table_notes is None:  # no family at all: the notes the whole table would give
        _, table_notes = rows_of(ds.read(columns, "FALSE"), rules)
    return finish_frontier(rows), notes + table_notes, rules
