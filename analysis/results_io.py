"""Reading the report's inputs: results and outcomes verified against their summary, and the
``tracesim peers`` tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq

__all__ = ["PEER_CLAIM_COLUMNS", "RESULT_FILES", "load_outcomes", "load_peers",
           "load_results"]

RESULT_FILES = ("results/results.parquet", "results.parquet", "replay.parquet")
#: Columns of ``peers.parquet`` that claim C10 reads.
PEER_CLAIM_COLUMNS = ("sequence_id", "config_id", "peer_bound_ok", "peer_den_ok", "kept_tokens")


def _read_json(path: Path) -> dict[str, Any] | None:
    """A results directory's JSON document (bounded reader), None if it is missing."""
    from tracesim.safeio import read_json

    if not path.exists() and not path.is_symlink():
        return None
    doc = read_json(path, "results summary")
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    return doc


def load_results(directory: str | Path, *, trust_unsigned: bool = False,
                 notes: list[str] | None = None) -> tuple[pd.DataFrame, dict[str, Any] | None]:
    """The replay results table and its summary from a sweep or replay output directory.

    The table must match what its ``summary.json`` records (row count, sha256, configuration
    ids) and have unique result keys and the required columns
    (:func:`tracesim.integrity.verify_results`); otherwise ``UsageError``. Results whose
    summary records nothing (written before tracesim recorded it) are refused unless
    ``trust_unsigned``, which appends a warning to ``notes`` instead.
    """
    from tracesim.integrity import verify_results

    d = Path(directory)
    for name in RESULT_FILES:
        if (d / name).is_file():
            path = d / name
            summary_path = path.parent / "summary.json"
            summary = _read_json(summary_path)
            # ParquetFile, not read_table: a file that is not Parquet is one ValueError
            with pq.ParquetFile(path) as fh:
                table = fh.read()
            found = verify_results(path, table, summary, summary_path,
                                   configs=path.parent / "configs.json",
                                   trust_unsigned=trust_unsigned)
            if notes is not None:
                notes.extend(found)
            return table.to_pandas(), summary
    raise ValueError(f"{d}: no results file found (expected one of {list(RESULT_FILES)})")


def load_outcomes(directory: str | Path, *, trust_unsigned: bool = False,
                  notes: list[str] | None = None) -> tuple[pd.DataFrame, dict[str, Any] | None]:
    """The in-loop outcomes (``tracesim evict``'s ``outcomes.parquet``) and their summary,
    checked as :func:`load_results` checks results: the summary's row count, sha256 and
    configuration ids, one row per (sequence, policy, seed, fetch scheduler and budget), the
    columns the claims read (:data:`tracesim.integrity.OUTCOME_COLUMNS`)."""
    from tracesim.integrity import OUTCOME_COLUMNS, OUTCOME_KEYS, verify_results

    d = Path(directory)
    path = d / "outcomes.parquet"
    if not path.is_file():
        raise ValueError(f"{d}: no outcomes.parquet")
    summary_path = d / "summary.json"
    summary = _read_json(summary_path)
    with pq.ParquetFile(path) as fh:
        table = fh.read()
    found = verify_results(path, table, summary, summary_path, trust_unsigned=trust_unsigned,
                           required=OUTCOME_COLUMNS, keys=OUTCOME_KEYS)
    if notes is not None:
        notes.extend(found)
    return table.to_pandas(), summary



def load_peers(directories: list[str | Path] | tuple[str | Path, ...]) -> pd.DataFrame:
    """The ``peers.parquet`` tables of ``tracesim peers`` output directories, in order.

    Each table must hold the columns C10 reads (:data:`PEER_CLAIM_COLUMNS`) and, where the
    directory has its ``peers.json``, the row count recorded there. ``tracesim peers`` records
    no sha256 of its table, so nothing stronger is checked: the report says so.

    Raises
    ------
    ValueError
        Naming the directory and what is missing or does not match.
    """
    frames = []
    for directory in directories:
        d = Path(directory)
        path = d / "peers.parquet"
        if not path.is_file():
            raise ValueError(f"{d}: no peers.parquet, expected a tracesim peers output "
                             "directory")
        with pq.ParquetFile(path) as fh:
            table = fh.read()
        missing = [c for c in PEER_CLAIM_COLUMNS if c not in table.column_names]
        if missing:
            raise ValueError(f"{path}: columns {missing} are missing, expected tracesim "
                             "peers output")
        record = _read_json(d / "peers.json")
        if record is not None and record.get("rows") != table.num_rows:
            raise ValueError(f"{path}: {table.num_rows} rows, expected the "
                             f"{record.get('rows')} that peers.json records")
        frames.append(table.to_pandas())
    if not frames:
        raise ValueError("expected at least one tracesim peers output directory")
    return pd.concat(frames)
