"""``tracesim export RESULTS``: results as CSV or as a hive-partitioned Parquet dataset.

A sweep's or replay's results are a dataset of parts (``results/parts``, verified part by part
and exported as one table in row order; the single ``results.parquet`` / ``replay.parquet`` of
earlier versions also reads), one row per (sequence, layer, head, query, configuration); large
sweeps are easier to query as a dataset partitioned by ``score``,
``design`` and ``budget`` (``OUT/score=snapkv/design=poisson/budget=0.25/part-0.parquet``),
which ``pyarrow.dataset``, DuckDB and polars read with partition pruning. CSV is for tools
without Parquet support. See ``docs/export.md``.

Rows are streamed batch by batch (memory stays bounded by one record batch), written into a
temporary sibling of the output directory and renamed into place once complete: a failed or
interrupted export leaves nothing under the final name.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

__all__ = ["FORMATS", "PARTITION_COLUMNS", "ExportError", "export_results", "find_results",
           "register"]

FORMATS = ("csv", "parquet-dataset")
#: Hive partition keys of ``parquet-dataset``, outermost first.
PARTITION_COLUMNS = ("score", "design", "budget")
#: Result files looked for in a results directory, in this order.
RESULT_FILES = ("results/manifest.json", "manifest.json", "results/results.parquet",
                "results.parquet", "replay.parquet", "outcomes.parquet")


class ExportError(ValueError):
    """Bad input or output for an export; the message names the path and what was expected."""


def find_results(path: str | os.PathLike) -> Path:
    """The Parquet results file of a sweep, replay or evict output (or the file itself), or the
    ``manifest.json`` of a sweep's results dataset (:mod:`tracesim.sweep.dataset`)."""
    p = Path(path)
    if p.is_file():
        if p.suffix != ".parquet" and p.name != "manifest.json":
            raise ExportError(f"{p}: not a Parquet file (expected a .parquet file or a results "
                              f"directory holding one of {list(RESULT_FILES)})")
        return p
    if not p.is_dir():
        if p.exists():  # a FIFO, a device: never opened
            raise ExportError(f"{p}: is not a regular file or a directory, expected a .parquet "
                              "results file or a results directory")
        raise ExportError(f"{p}: no such file or directory")
    for name in RESULT_FILES:
        if (p / name).is_file():
            return p / name
    raise ExportError(f"{p}: no results file found (expected one of {list(RESULT_FILES)})")


def _budget_as_null(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``budget`` NaN (the full cache has none) becomes null, so it partitions as missing."""
    i = batch.schema.get_field_index("budget")
    col = batch.column(i)
    if pa.types.is_floating(col.type):
        col = pc.if_else(pc.is_nan(col), pa.scalar(None, col.type), col)
        batch = batch.set_column(i, "budget", col)
    return batch


def _open(source: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(source)
    except (pa.ArrowInvalid, OSError) as exc:
        raise ExportError(f"{source}: not a readable Parquet file ({exc})") from None


def _configs_json(manifest: Path) -> Path:
    """The run's ``configs.json``: inside ``results/`` (replay, peers) or beside it (sweep)."""
    here = manifest.parent / "configs.json"
    return here if here.is_file() else manifest.parent.parent / "configs.json"


def _source(source: Path, batch_rows: int) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """Schema and record batches of a results file, or of a results dataset's parts, in order
    (a dataset is verified part by part first, as the report verifies it)."""
    if source.name != "manifest.json":
        pf = _open(source)
        return pf.schema_arrow, pf.iter_batches(batch_size=batch_rows)
    from tracesim.dataset_read import verify_dataset
    from tracesim.errors import UsageError
    from tracesim.safeio import read_json

    summary_path = source.parent / "summary.json"
    try:
        summary = read_json(summary_path, "results summary") if summary_path.is_file() else None
        parts, _ = verify_dataset(source.parent, summary if isinstance(summary, dict) else None,
                                  summary_path, configs=_configs_json(source),
                                  trust_unsigned=True, required={})
    except UsageError as exc:
        raise ExportError(str(exc)) from None
    schema = _open(parts[0]).schema_arrow.remove_metadata()

    def batches() -> Iterator[pa.RecordBatch]:
        for part in parts:
            for batch in _open(part).iter_batches(batch_size=batch_rows):
                yield pa.RecordBatch.from_arrays(batch.columns, schema=schema)
    return schema, batches()


def _write_csv(source: Path, tmp: Path, name: str, batch_rows: int) -> int:
    schema, batches = _source(source, batch_rows)
    rows = 0
    options = pacsv.WriteOptions(include_header=True)  # nulls are written as empty fields
    with pacsv.CSVWriter(tmp / f"{name}.csv", schema, write_options=options) as writer:
        for batch in batches:
            writer.write_batch(batch)
            rows += batch.num_rows
    return rows


def _write_dataset(source: Path, tmp: Path, batch_rows: int, max_rows_per_file: int) -> int:
    schema, source_batches = _source(source, batch_rows)
    missing = [c for c in PARTITION_COLUMNS if c not in schema.names]
    if missing:
        raise ExportError(f"{source}: column(s) {missing} missing; a parquet-dataset is "
                          f"partitioned by {list(PARTITION_COLUMNS)} (use --format csv)")
    from tracesim.hive_writer import write_hive

    # not pyarrow's write_dataset: it queues up to 64M rows before its writers catch up
    return write_hive((_budget_as_null(b) for b in source_batches), schema, tmp,
                      PARTITION_COLUMNS, max_rows_per_file=max_rows_per_file,
                      row_group_rows=min(max_rows_per_file, 1 << 17))


def export_results(results: str | os.PathLike, out: str | os.PathLike, fmt: str, *,
                   overwrite: bool = False, batch_rows: int = 65_536,
                   max_rows_per_file: int = 5_000_000) -> tuple[Path, int]:
    """Export a results table; return ``(output directory, rows written)``.

    Parameters
    ----------
    results : path
        A ``.parquet`` results file, or a sweep / replay / evict output directory
        (:data:`RESULT_FILES`).
    out : path
        Output directory; it must not exist unless ``overwrite``.
    fmt : {"csv", "parquet-dataset"}
        ``csv``: one file ``OUT/<name>.csv`` (header row; nulls as empty fields; NaN as
        ``nan``). ``parquet-dataset``: hive-partitioned by :data:`PARTITION_COLUMNS`; a NaN
        budget (full cache) is written as a null partition value.
    overwrite : bool, default False
        Replace an existing ``out`` (only once the new export is complete, and only if it is
        an earlier export: it carries :data:`tracesim.outpaths.MARKER`).
    batch_rows : int, default 65536
        Rows read per record batch (bounds memory).
    max_rows_per_file : int, default 5,000,000
        Largest Parquet file of the dataset, in rows.

    Raises
    ------
    ExportError
        Naming the path and the problem: missing input, unknown format, existing output.
    """
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: expected one of {list(FORMATS)}")
    for name, value in (("batch_rows", batch_rows), ("max_rows_per_file", max_rows_per_file)):
        if not isinstance(value, int) or value < 1:
            raise ExportError(f"{name} = {value!r}: expected an integer >= 1")
    from tracesim.outpaths import check_output, check_replaceable, mark_output

    source = find_results(results)
    # never write over what is read: the results file and the directory it was found in
    out = check_output(out, [("results", results), ("results file", source)], "--out",
                       ExportError)
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise ExportError(f"{out}: already exists (choose another --out or pass --overwrite)")
    if out.exists() or out.is_symlink():  # --overwrite replaces only an earlier export
        check_replaceable(out, "export", "--out", ExportError)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir()
    try:
        if fmt == "csv":
            name = "results" if source.name == "manifest.json" else source.stem
            rows = _write_csv(source, tmp, name, batch_rows)
        else:
            rows = _write_dataset(source, tmp, batch_rows, max_rows_per_file)
        mark_output(tmp, "export")
        if out.exists():
            old = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.old")
            os.replace(out, old)
            try:
                os.replace(tmp, out)
            except BaseException:  # put the earlier export back: never neither
                os.replace(old, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, rows


def _command(args: argparse.Namespace) -> int:
    try:
        out, rows = export_results(args.results, args.out, args.format,
                                   overwrite=args.overwrite,
                                   max_rows_per_file=args.max_rows_per_file)
    except ExportError as exc:
        print(f"tracesim export: {exc}", file=sys.stderr)
        return 2
    except pa.ArrowInvalid as exc:
        print(f"tracesim export: {args.results}: {exc}", file=sys.stderr)
        return 2
    kind = "CSV" if args.format == "csv" else "hive-partitioned Parquet dataset (" + \
        "/".join(f"{c}=..." for c in PARTITION_COLUMNS) + ")"
    print(f"{rows} rows -> {out} ({kind})")
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tracesim export``."""
    p = subparsers.add_parser(
        "export", help="export results as CSV or a hive-partitioned Parquet dataset",
        description="Export the results of a sweep (OUT/results/: its parts as one table), a "
        "replay "
        "(replay.parquet) or an in-loop run (outcomes.parquet). 'parquet-dataset' writes one "
        "directory per score/design/budget (hive partitioning) that pyarrow.dataset, DuckDB "
        "and polars read with partition pruning; 'csv' writes one file with a header row and "
        "nulls as empty fields. The output appears only once complete. See docs/export.md.",
        epilog="examples:\n"
        "  tracesim export sweep-out/ --format parquet-dataset --out results-ds/\n"
        "  tracesim export replay-out/replay.parquet --format csv --out replay-csv/")
    p.add_argument("results", metavar="RESULTS",
                   help="a results .parquet file, or a sweep / replay / evict output directory")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="csv (one file) or parquet-dataset (hive-partitioned by score, design "
                   "and budget)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="output directory (must not exist unless --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output directory once the export is complete")
    p.add_argument("--max-rows-per-file", type=_positive_int, default=5_000_000, metavar="ROWS",
                   help="parquet-dataset: largest file, in rows (default: %(default)s)")
    p.set_defaults(func=_command)
