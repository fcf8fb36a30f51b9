"""``tracesim frontier``'s reader: the frontier and its validity rules one family at a time.

The frontier's rows are groups of one family (a configuration without its budget) and its
budgets; a validity rule is fitted on one configuration's certified calibration rows. So the
results are never loaded whole: :func:`open_frontier_results` verifies them and opens a
:class:`~tracesim.analysis.aggregate.ResultsDataset`; one grouped scan gives one row per
configuration (its family columns, row count, first row); the families are packed into reads
of up to :data:`CHUNK_ROWS` rows (a larger family alone), and one more pass copies the
frontier's columns into a temporary Parquet file sorted by read, so each read touches only its
own row groups instead of scanning every part (at 10^7 rows ~40 reads did, issue 28). Each
read's rules are fitted on its rows and its frontier rows computed by the same code as the
in-memory :func:`tracesim.analysis.frontier.frontier_table`: memory is one read's rows and
DuckDB's limit, never the table's. The per-step section is computed from sums
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


def _config_summary(ds: ResultsDataset) -> pd.DataFrame:
    """One row per configuration from one grouped scan of the rows (no window over them): its
    first row overall (``any_row``) and among its non-``full`` rows (``first_row``, with that
    row's family columns), its non-``full`` row count, whether it has ``full`` rows, and for
    the whole table's questions the least and greatest ``store`` of its non-``full`` rows and
    its greatest ``n_seeds``."""
    keys = [c for c in _FAMILY if c in ds]
    packed = ", ".join(f"{quote(k)} := {quote(k)}" for k in keys)
    agg = [f"arg_min(struct_pack({packed}), __row) FILTER (WHERE {_NOT_FULL}) AS __keys",
           f"min(__row) FILTER (WHERE {_NOT_FULL}) AS first_row", "min(__row) AS any_row",
           f"count(*) FILTER (WHERE {_NOT_FULL}) AS rows",
           "COALESCE(bool_or(\"score\" = 'full'), FALSE) AS has_full"]
    if "store" in ds:
        agg += [f"min(\"store\") FILTER (WHERE {_NOT_FULL}) AS store_min",
                f"max(\"store\") FILTER (WHERE {_NOT_FULL}) AS store_max"]
    if "n_seeds" in ds:
        agg.append("max(\"n_seeds\") AS max_seeds")
    fields = ", ".join(f"__keys.{quote(k)} AS {quote(k)}" for k in keys)
    return ds.query(f"SELECT config_id, {fields}, * EXCLUDE (config_id, __keys) FROM ("
                    f"SELECT CAST(\"config_id\" AS VARCHAR) AS config_id, {', '.join(agg)} "
                    "FROM results WHERE \"config_id\" IS NOT NULL GROUP BY 1) ORDER BY any_row")


def _families(configs: pd.DataFrame) -> tuple[dict[str, str], dict[str, list[str]]]:
    """``config_id -> family label`` (as :func:`family_labels` of the whole table labels it)
    and the configurations of each family, from :func:`_config_summary`."""
    first = configs[configs["first_row"].notna()].sort_values("first_row")
    if first.empty:
        return {}, {}
    labels = family_labels(first[[c for c in _FAMILY if c in first]].reset_index(drop=True))
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


def _read_chunk(rows: ResultsDataset | None, columns: list[str], chunk: int) -> pd.DataFrame:
    """One read of :func:`_rows_by_chunk`'s copy: its rows, in the table's order (the
    identifiers as categoricals, as the whole-table reader gave them)."""
    if rows is None:  # a read is only planned when some configuration has rows to copy
        raise ValueError("frontier: a read of rows that were not copied")
    df = rows.read(columns, f"\"__chunk\" = {int(chunk)}")
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


def _fit_notes(configs: pd.DataFrame, rules: dict[str, ValidityRule], failed: list[str],
               with_tail_weight: bool) -> tuple[dict[str, ValidityRule], list[str]]:
    """The rules and :func:`fit_rules`' notes, in the order the whole-table reader grouped the
    configurations (categoricals in the order of their first row)."""
    order = {cid: i for i, cid in enumerate(configs.sort_values("any_row")["config_id"])}
    failed = sorted(failed, key=order.__getitem__)
    notes = fit_notes(failed, with_tail_weight)
    return dict(sorted(rules.items(), key=lambda kv: order[kv[0]])), notes


def _chunks(configs: pd.DataFrame, members: dict[str, list[str]], limit: int
            ) -> list[list[str]]:
    """The families in label order, packed into reads of at most ``limit`` rows (a larger
    family is one read of its own): memory bounded by a read."""
    per_config = dict(zip(configs["config_id"], configs["rows"], strict=True))
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


def _rows_by_chunk(ds: ResultsDataset, columns: list[str], chunk_of: dict[str, int],
                   full_chunk: int | None, directory: Path) -> ResultsDataset:
    """The frontier's rows copied once into one Parquet file sorted by read (``__chunk``, the
    index of the read a row's configuration belongs to), each read's rows in the table's order:
    a read of one chunk then touches only its own row groups (their ``__chunk`` statistics),
    where a read of the results by configuration scans every part. The certified rows of the
    ``full`` configurations are the chunk ``full_chunk``. One pass over the results; the sort
    spills to disk beyond DuckDB's memory limit."""
    con = ds.connection()
    chunks = pd.DataFrame({"config_id": list(chunk_of), "__chunk": list(chunk_of.values())})
    con.register("__frontier_chunks", chunks)
    keep = _NOT_FULL if full_chunk is None else (
        f"(m.__chunk < {full_chunk} AND {_NOT_FULL}) OR "
        f"(m.__chunk = {full_chunk} AND {certified_where()})")
    path = directory / "rows.parquet"
    target = "'" + str(path).replace("'", "''") + "'"
    try:
        con.execute(f"COPY (SELECT {', '.join('r.' + quote(c) for c in columns)}, m.__chunk "
                    "FROM results r JOIN __frontier_chunks m ON CAST(r.\"config_id\" AS "
                    f"VARCHAR) = m.config_id WHERE {keep} ORDER BY m.__chunk, r.__row) TO "
                    f"{target} (FORMAT parquet)")
    finally:
        con.unregister("__frontier_chunks")
    return ResultsDataset(files=[path], summary=None, columns=(*columns, "__chunk"),
                          n_rows=pq.ParquetFile(path).metadata.num_rows,
                          memory_limit=ds.memory_limit, threads=ds.threads)


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
    computes them from the whole table, reading a few families' rows at a time: each family's
    rules are fitted on its own rows, then its frontier rows computed. The results are scanned
    three times whatever their size (the sequences, one row per configuration, and one copy of
    the frontier's rows sorted by read, :func:`_rows_by_chunk`); the reads hit that copy."""
    import tempfile

    columns = [c for c in (*REQUIRED_COLUMNS, *OPTIONAL_COLUMNS) if c in ds]
    seqs = ds.query("SELECT DISTINCT CAST(\"sequence_id\" AS VARCHAR) AS s FROM results "
                    "WHERE \"sequence_id\" IS NOT NULL")["s"]
    split = split_sequences(seqs, settings.salt, settings.fraction)
    held = [s for s, c in split.items() if not c]
    notes = [f"validity rules: split salt `{settings.salt}`, calibration fraction "
             f"{settings.fraction}: {len(split) - len(held)} calibration, {len(held)} held-out "
             f"sequences"]
    configs = _config_summary(ds)
    families, members = _families(configs)
    if given is not None:
        check_rules(given, settings, held)
    stores = (configs["store_min"].dropna().tolist() + configs["store_max"].dropna().tolist()
              if "store" in ds else [])
    kinds = [k for k in STRATA if k != "store" or len(set(stores)) > 1]
    fitted: dict[str, ValidityRule] = {}
    failed: list[str] = []
    # per family: its rows with the rules it has, or (without a rule of its own) with none at
    # all and with others' only; which applies is known once every family is fitted
    parts: list[tuple[list, list, list | None, list | None]] = []

    def rows_of(chunk: pd.DataFrame, rules: dict | None) -> tuple[list, list[str]]:
        return frontier_rows(chunk, rules=rules or None, salt=settings.salt,
                             fraction=settings.fraction, alpha=alpha, families=families,
                             kinds=kinds)

    reads = _chunks(configs, members, chunk_rows or CHUNK_ROWS)
    chunk_of = {c: i for i, fams in enumerate(reads) for f in fams for c in members[f]}
    full = configs.loc[configs["has_full"].astype(bool), "config_id"].tolist()
    # the full configurations' certified rows are one more read of the sorted copy, unless a
    # configuration has full and other rows (then they are read from the results)
    with_full = given is None and bool(full) and not set(full) & set(chunk_of)
    if with_full:
        chunk_of.update({c: len(reads) for c in full})
    with tempfile.TemporaryDirectory(prefix="tracesim-frontier-") as tmp:
        rows_ds = (_rows_by_chunk(ds, columns, chunk_of, len(reads) if with_full else None,
                                  Path(tmp)) if chunk_of else None)
        try:
            for i, fams in enumerate(reads):
                df = _read_chunk(rows_ds, columns, i)
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
            if given is None and full:
                _fit_rows(_read_chunk(rows_ds, columns, len(reads)) if with_full else
                          _read_family(ds, columns, full, certified_where()), settings,
                          fitted, failed)
        finally:
            if rows_ds is not None:
                rows_ds.close()
    if given is None:
        rules, fit_notes = _fit_notes(configs, fitted, failed, "max_tail_weight" in ds)
        notes += fit_notes
        check_rules(rules, settings, held)
    else:
        rules = given
    if "n_seeds" in ds and (configs["max_seeds"] > 1).any():
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
