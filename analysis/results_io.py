"""Reading the report's inputs: results and outcomes verified against their summary, and the
``tracesim peers`` tables."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq

__all__ = ["PEER_CLAIM_COLUMNS", "REPORT_COLUMNS", "RESULT_FILES", "load_outcomes", "load_peers",
           "load_results", "read_verified"]

#: Where results are looked for in an output directory, in this order: a sweep's results
#: dataset (``manifest.json`` + ``parts/``, :mod:`tracesim.sweep.dataset`), then the single
#: files of replay and of earlier sweeps.
RESULT_FILES = ("results/manifest.json", "manifest.json", "results/results.parquet",
                "results.parquet", "replay.parquet")
#: Columns of ``peers.parquet`` that claim C10 reads.
PEER_CLAIM_COLUMNS = ("sequence_id", "config_id", "peer_bound_ok", "peer_den_ok", "kept_tokens")
#: Results columns that ``tracesim report`` (its claims, figures, tables and provenance) reads:
#: the projection :func:`load_results` pushes into the Parquet reads, so the ~20 columns no
#: consumer reads (diagnostics such as ``design_params``, ``err2_sd``, ``layer_err2``) never
#: reach memory. Columns absent from a table (optional ones, older versions) are skipped.
#: ``tests/test_results_dataset.py`` checks that every documented results column quoted in
#: the analysis code is listed here.
REPORT_COLUMNS = (
    "store", "model_id", "sequence_id", "task", "correct", "layer", "head", "kv_head",
    "query_position", "query_role", "prompt_length", "n_positions", "config_id", "score",
    "design", "correction", "budget", "budget_unit", "allocator", "alpha", "beta", "schedule",
    "sinks", "window", "top_fraction", "mixture", "floor", "score_params", "certified",
    "summary_page", "deployable", "seed", "n_seeds", "err2", "rel_err", "cert2", "tail_size",
    "n_eff", "wald_cov", "wald_t_cov", "sat_cov", "sat_t_cov", "kept_tokens", "tail_out_mass",
    "max_tail_weight", "bound2", "bound_cov", "summary_tokens", "boot_cov", "boot_cert2",
    "attention_kind")


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
                 notes: list[str] | None = None, columns: Sequence[str] | None = None,
                 ) -> tuple[pd.DataFrame, dict[str, Any] | None]:
    """The replay results table and its summary from a sweep or replay output directory.

    The table must match what its ``summary.json`` records (row count, sha256, configuration
    ids) and have unique result keys and the required columns
    (:func:`tracesim.integrity.verify_results`); otherwise ``UsageError``. Results whose
    summary records nothing (written before tracesim recorded it) are refused unless
    ``trust_unsigned``, which appends a warning to ``notes`` instead. ``columns`` (e.g.
    :data:`REPORT_COLUMNS`) limits what is read to those of them the table has, after the
    checks; the rest are never read from the part files.
    """
    d = Path(directory)
    for name in RESULT_FILES:
        if (d / name).is_file():
            table, summary = read_verified(d / name, trust_unsigned=trust_unsigned,
                                           notes=notes, columns=columns, present_only=True)
            # Arrow buffers are released column by column as pandas takes them over, so the
            # table and the frame are not both whole in memory at the peak
            return table.to_pandas(self_destruct=True, split_blocks=True), summary
    raise ValueError(f"{d}: no results file found (expected one of {list(RESULT_FILES)})")


def _configs_path(results_file: Path) -> Path:
    """The run's ``configs.json``: beside the results (replay), or one level up for a
    sweep's ``results/`` directory."""
    here = results_file.parent / "configs.json"
    if here.is_file() or results_file.parent.name != "results" or results_file.name not in (
            "results.parquet", "manifest.json"):
        return here
    return results_file.parent.parent / "configs.json"


def _open_parquet(path: Path):
    """``ParquetFile`` of a results file; a damaged one is a one-line error naming it."""
    import pyarrow as pa

    from tracesim.errors import UsageError

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise UsageError(f"{path}: not a readable Parquet file ({exc}), expected the results "
                         "its summary.json describes") from None


def read_verified(path: Path, *, trust_unsigned: bool = False, notes: list[str] | None = None,
                  columns: Sequence[str] | None = None, required: dict[str, str] | None = None,
                  present_only: bool = False):
    """The verified rows (a ``pyarrow.Table``) and summary of one results file or a results
    dataset's ``manifest.json``; ``columns`` limits what is read (after the checks), to those
    the table has if ``present_only``."""
    from tracesim.dataset_read import MANIFEST_FILE, read_dataset, verify_dataset
    from tracesim.integrity import verify_results

    summary_path = path.parent / "summary.json"
    summary = _read_json(summary_path)
    if path.name == MANIFEST_FILE:
        parts, found = verify_dataset(path.parent, summary, summary_path,
                                      configs=_configs_path(path),
                                      trust_unsigned=trust_unsigned, required=required)
        if columns and present_only and parts:
            have = set(pq.read_schema(parts[0]).names)
            columns = [c for c in columns if c in have]
        table = read_dataset(parts, columns)
    else:
        with _open_parquet(path) as fh:
            try:
                table = fh.read()
            except (OSError, ValueError) as exc:
                from tracesim.errors import UsageError

                raise UsageError(f"{path}: not a readable Parquet file ({exc})") from None
        found = verify_results(path, table, summary, summary_path,
                               configs=_configs_path(path), trust_unsigned=trust_unsigned,
                               required=required)
        _check_listed_ids(path, table, summary, summary_path)
        if columns:
            table = table.select([c for c in columns if c in table.column_names]
                                 if present_only else list(columns))
    if notes is not None:
        notes.extend(found)
    return table, summary


def _check_listed_ids(path: Path, table, summary: dict[str, Any] | None,
                      summary_path: Path) -> None:
    """Refuse a summary listing configuration ids that have no rows (a padded record)."""
    from tracesim.errors import UsageError

    listed = summary.get("config_ids") if isinstance(summary, dict) else None
    if not isinstance(listed, list):
        return
    have = set(table["config_id"].unique().to_pylist())
    empty = sorted(str(i) for i in set(listed) - have)
    if empty:
        raise UsageError(f"{summary_path}: field 'config_ids' lists {empty[0]!r} "
                         f"({len(empty)} id(s)) with no rows in {path.name}, expected only "
                         "configurations that have rows")


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
    with _open_parquet(path) as fh:
        table = fh.read()
    found = verify_results(path, table, summary, summary_path, trust_unsigned=trust_unsigned,
                           required=OUTCOME_COLUMNS, keys=OUTCOME_KEYS)
    if notes is not None:
        notes.extend(found)
    return table.to_pandas(), summary



def load_peers(directories: list[str | Path] | tuple[str | Path, ...]) -> pd.DataFrame:
    """The ``peers.parquet`` tables of ``tracesim peers`` output directories, in order: their
    results dataset (``results/``, verified part by part against its signed summary) or the
    single ``peers.parquet`` of earlier versions.

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
        if (d / "results" / "manifest.json").is_file():  # the results dataset of tracesim peers
            from tracesim.dataset_read import read_results

            frames.append(read_results(d, PEER_CLAIM_COLUMNS, required={
                "sequence_id": "string", "peer_bound_ok": "floating",
                "peer_den_ok": "floating", "kept_tokens": "floating"}).to_pandas())
            continue
        path = d / "peers.parquet"
        if not path.is_file():
            raise ValueError(f"{d}: no peers.parquet, expected a tracesim peers output "
                             "directory")
        with _open_parquet(path) as fh:
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
