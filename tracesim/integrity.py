"""What a results summary records about its results, and the check readers make against it.

``evict`` and ``tiers`` (``OUT/summary.json``) record, for the results file they describe, its
name, row count, ``sha256`` and the set of configuration ids (:func:`results_record`); so did
``replay`` and ``sweep`` in earlier versions, whose single files still read. ``replay``,
``sweep`` and ``peers`` now write a results dataset whose ``results/summary.json`` records the
same fields for its ``manifest.json`` (:mod:`tracesim.dataset`; checked part by part by
:func:`tracesim.dataset_read.verify_dataset`). The summary is committed after the results
(one unit, :func:`tracesim.atomic.atomic_files`), so a run killed between the two renames leaves a
mismatch, not a silent mix. :func:`verify_results` is what the report and the frontier run
before trusting a table: it refuses a hash or row-count mismatch, duplicate result keys, rows
of configurations the summary does not list, and a missing or mistyped column. A consistent
lie (results edited and every record recomputed) cannot be detected this way
(``docs/threat-model.md``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa

from tracesim.digests import sha256_file
from tracesim.errors import UsageError

__all__ = ["KEY_COLUMNS", "OUTCOME_COLUMNS", "OUTCOME_KEYS", "RECORD_FIELDS",
           "REQUIRED_COLUMNS", "file_sha256", "results_record", "sign_results",
           "verify_results"]

#: Fields of a summary that describe its results file.
RECORD_FIELDS = ("results_file", "results_sha256", "n_rows", "config_ids")
#: Columns that identify one result row (those present are used: ``store`` only in sweeps,
#: ``seed`` is null on rows aggregated over seeds).
KEY_COLUMNS = ("store", "sequence_id", "layer", "head", "query_index", "config_id", "seed")
#: Columns every reader of results needs, with the kind of Arrow type each must have.
REQUIRED_COLUMNS = {"config_id": "string", "score": "string", "design": "string",
                    "sequence_id": "string", "layer": "integer", "head": "integer",
                    "query_index": "integer", "err2": "floating", "wald_cov": "floating"}

#: Columns that identify one in-loop outcome row (``tracesim evict``): a (sequence, policy,
#: seed), once per fetch scheduler and fetch budget when fetches ran.
OUTCOME_KEYS = ("sequence_id", "config_id", "seed", "fetch_scheduler", "fetch_budget",
                "fetch_page")
#: Columns every reader of outcomes needs.
OUTCOME_COLUMNS = {"config_id": "string", "sequence_id": "string", "score": "string",
                   "design": "string", "correct": "boolean", "full_correct": "boolean"}

_KINDS = {"string": (pa.types.is_string, pa.types.is_large_string, pa.types.is_dictionary),
          "integer": (pa.types.is_integer,), "floating": (pa.types.is_floating,),
          "boolean": (pa.types.is_boolean,)}


def file_sha256(path: str | Path) -> str:
    """``sha256:<hex>`` of a results file (regular files only; no size limit: a results file is
    read whole anyway)."""
    return sha256_file(path, "results file")


def results_record(path: str | Path, n_rows: int, config_ids: Iterable[str]) -> dict[str, Any]:
    """The summary fields describing the results file ``path`` (see :data:`RECORD_FIELDS`)."""
    path = Path(path)
    return {"results_file": path.name, "results_sha256": file_sha256(path),
            "n_rows": int(n_rows), "config_ids": sorted(set(config_ids))}


def sign_results(results: str | Path, summary: str | Path | None = None) -> dict[str, Any]:
    """Add :func:`results_record` of ``results`` to its ``summary.json`` (created if missing).

    For results written through the Python API (``tracesim.replay.replay`` then
    ``pyarrow.parquet.write_table``): the command-line tools sign their own. Returns the
    summary written.
    """
    import json

    import pyarrow.parquet as pq

    results = Path(results)
    summary = Path(summary) if summary is not None else results.parent / "summary.json"
    doc = json.loads(summary.read_text()) if summary.exists() else {}
    with pq.ParquetFile(results) as fh:
        n = fh.metadata.num_rows
        ids = fh.read(columns=["config_id"]).column("config_id").to_pylist()
    doc.update(results_record(results, n, (i for i in ids if i is not None)))
    from tracesim.atomic import atomic_write_text

    atomic_write_text(summary, json.dumps(doc, indent=1))
    return doc


def _check_columns(table: pa.Table, path: Path, required: dict[str, str]) -> None:
    for name, kind in required.items():
        if name not in table.column_names:
            raise UsageError(f"{path}: column {name!r} is missing, expected a {kind} column")
        typ = table.schema.field(name).type
        if not any(test(typ) for test in _KINDS[kind]):
            raise UsageError(f"{path}: column {name!r} has type {typ}, expected a {kind} "
                             "column")


def _check_keys(table: pa.Table, path: Path, keys: tuple[str, ...] = KEY_COLUMNS) -> None:
    import pyarrow.compute as pc

    cols = [c for c in keys if c in table.column_names]
    if table.num_rows == 0:
        return
    # one string per row: exact, and linear (no pandas needed)
    parts = [pc.cast(table[c], pa.string()).fill_null("\x00") for c in cols]
    keys = pc.binary_join_element_wise(*parts, "\x1f")
    n_unique = len(pc.unique(keys))
    if n_unique != table.num_rows:
        counts = pc.value_counts(keys)
        dup = next(v["values"].as_py() for v in counts if v["counts"].as_py() > 1)
        shown = dict(zip(cols, dup.replace("\x00", "null").split("\x1f"), strict=False))
        raise UsageError(f"{path}: {table.num_rows - n_unique} row(s) repeat a result key "
                         f"({', '.join(cols)}), e.g. {shown}, expected each key once")


def _configs_json_ids(configs: Path) -> set[str] | None:
    from tracesim.safeio import read_json

    if not configs.is_file():
        return None
    doc = read_json(configs, "results configs")
    items = doc.get("configs") if isinstance(doc, dict) else doc
    if not isinstance(items, list):
        raise UsageError(f"{configs}: field 'configs' is {type(items).__name__}, expected a "
                         "list of configurations")
    return {c.get("id") for c in items if isinstance(c, dict)}


def verify_results(path: str | Path, table: pa.Table, summary: dict[str, Any] | None,
                   summary_path: str | Path, *, configs: str | Path | None = None,
                   trust_unsigned: bool = False,
                   required: dict[str, str] | None = None,
                   keys: tuple[str, ...] = KEY_COLUMNS) -> list[str]:
    """Refuse results that do not match the summary describing them; return notes.

    Parameters
    ----------
    path : path
        The results file ``table`` was read from.
    table : pyarrow.Table
    summary : dict or None
        The parsed summary (None: there is none).
    summary_path : path
        Where the summary is (or should be), for messages.
    configs : path, optional
        A ``configs.json`` listing the configurations run; rows of others are refused.
    trust_unsigned : bool
        Accept a summary without :data:`RECORD_FIELDS` (results written before tracesim
        recorded them) with a note instead of refusing. Columns and keys are still checked.
    required : dict, optional
        Column name -> kind (``string``, ``integer``, ``floating``) the reader needs (default
        :data:`REQUIRED_COLUMNS`); ``config_id`` is always required.
    keys : tuple of str
        Columns that identify a row (those present are used; default :data:`KEY_COLUMNS`,
        :data:`OUTCOME_KEYS` for in-loop outcomes).

    Raises
    ------
    tracesim.errors.UsageError
        One line naming the file, the field and what was expected.
    """
    path, summary_path = Path(path), Path(summary_path)
    notes: list[str] = []
    record = summary if isinstance(summary, dict) and "results_sha256" in summary else None
    if record is None:
        if not trust_unsigned:
            raise UsageError(
                f"{summary_path}: field 'results_sha256' is missing, expected the row count and "
                f"sha256 of {path.name} (written by tracesim replay/sweep/evict; rerun them, "
                "or sign API-written results with tracesim.integrity.sign_results, or pass "
                "--trust-unsigned)")
        notes.append(f"UNSIGNED RESULTS: {path} has no row count or sha256 in {summary_path}; "
                     "its rows were taken on trust")
    else:
        name = record.get("results_file")
        if name != path.name:
            raise UsageError(f"{summary_path}: field 'results_file' is {name!r}, expected "
                             f"{path.name!r} (the summary describes other results)")
        digest = file_sha256(path)
        if record["results_sha256"] != digest:
            raise UsageError(f"{summary_path}: field 'results_sha256' is "
                             f"{record['results_sha256']}, expected {digest} (the sha256 of "
                             f"{path.name}: the results changed after the summary was written)")
        cids = record.get("config_ids")
        if cids is not None and not (isinstance(cids, list)
                                     and all(isinstance(c, str) for c in cids)):
            raise UsageError(f"{summary_path}: field 'config_ids' is not a list of strings, "
                             "expected the configuration ids of the results")
        if record.get("n_rows") != table.num_rows:
            raise UsageError(f"{summary_path}: field 'n_rows' is {record.get('n_rows')!r}, "
                             f"expected {table.num_rows} (the rows of {path.name})")
    if table.num_rows == 0:
        raise UsageError(f"{path}: has 0 rows, expected at least one result row (an empty "
                         "table would make every claim inconclusive without saying why)")
    _check_columns(table, path, {"config_id": "string",
                                 **(REQUIRED_COLUMNS if required is None else required)})
    _check_keys(table, path, keys)
    ids = set(table["config_id"].unique().to_pylist())
    listed = [(summary_path, "config_ids",
               set(record["config_ids"]) if record and isinstance(record.get("config_ids"),
                                                                  list) else None)]
    if configs is not None:
        listed.append((Path(configs), "configs", _configs_json_ids(Path(configs))))
    for where, fld, known in listed:
        if known is None:
            continue
        foreign = sorted(str(i) for i in ids - known)
        if foreign:
            raise UsageError(f"{path}: column 'config_id' holds {len(foreign)} configuration(s) "
                             f"not in {where} field {fld!r} (e.g. {foreign[0]!r}), expected "
                             "only the configurations that run produced")
    return notes
