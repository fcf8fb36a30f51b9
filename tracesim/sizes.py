"""One estimate of memory and work before anything is allocated: products of sizes.

:mod:`tracesim.counts` bounds each count alone; a product of counts that are each within their
bound (``synth --positions 1048576 --layers 4096 --sequences 10000``, a manifest of 10**6
sequences, 2*10**8 token ids in a 10 kB Parquet file) can still ask for terabytes. Every such
product is estimated here from sizes known *before* the allocation (options, ``model.json``,
Parquet and Arrow footers) and refused with the estimate and the limit, as one line naming the
option or file (``docs/threat-model.md``).
"""

from __future__ import annotations

import os
from pathlib import Path

from tracesim.errors import UsageError

__all__ = ["ARROW_FOOTER_BYTES", "MANIFEST_BYTES", "MANIFEST_DECODED_BYTES", "MANIFEST_ROWS",
           "MANIFEST_VALUES", "MEMORY_BYTES", "PARQUET_FOOTER_BYTES", "WRITE_BYTES",
           "arrow_footer_bytes", "check_estimate", "human", "parquet_footer_bytes"]

ErrorType = type[Exception]

#: Memory one command may plan to hold at once (a synthetic layer, o_proj weights).
MEMORY_BYTES = 16 << 30
#: Bytes one command may plan to write (a synthetic store).
WRITE_BYTES = 1 << 40
#: ``manifest.parquet``: file size, sequences (rows), list items over every list column
#: (token ids, query positions, ...) and decoded bytes, all read from the footer first.
MANIFEST_BYTES = 256 << 20
MANIFEST_ROWS = 100_000
MANIFEST_VALUES = 1 << 27
MANIFEST_DECODED_BYTES = 1 << 30
#: Footer of a Parquet file (its metadata) and of an Arrow IPC tensor file (its schema, whose
#: metadata holds the JSON tensor index): the JSON limit of every other file.
PARQUET_FOOTER_BYTES = 16 << 20
ARROW_FOOTER_BYTES = 16 << 20


def human(n: float) -> str:
    """``n`` bytes as ``12.3 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def check_estimate(estimate: float, limit: int, where: str, what: str,
                   error: ErrorType = UsageError, unit: str = "bytes") -> None:
    """Refuse ``estimate > limit``: ``WHERE: needs about X of WHAT, expected at most Y``."""
    if estimate > limit:
        if unit == "bytes":
            shown, bound = human(estimate), human(limit)
        else:
            shown, bound = f"{estimate:.0f} {unit}", f"{limit} {unit}"
        raise error(f"{where}: needs about {shown} of {what}, expected at most {bound}")


def _tail(path: Path, n: int) -> bytes:
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < n:
            return b""
        fh.seek(size - n)
        return fh.read(n)


def parquet_footer_bytes(path: str | os.PathLike) -> int | None:
    """Length of a Parquet file's footer (metadata) from its last 8 bytes; None if the file
    does not end like Parquet (the reader then says so)."""
    tail = _tail(Path(path), 8)
    if len(tail) != 8 or tail[4:] != b"PAR1":
        return None
    return int.from_bytes(tail[:4], "little")


def arrow_footer_bytes(path: str | os.PathLike) -> int | None:
    """Length of an Arrow IPC file's footer (schema and its metadata) from its last 10 bytes;
    None if the file does not end like Arrow IPC."""
    tail = _tail(Path(path), 10)
    if len(tail) != 10 or tail[4:] != b"ARROW1":
        return None
    return int.from_bytes(tail[:4], "little", signed=True)
