"""The trace store: recorded attention traces on disk, memory-mapped for reading.

A store is a directory holding ``model.json`` (:class:`ModelMeta`), ``manifest.parquet`` (one row
per finished sequence), an optional ``o_proj.arrow`` and one Arrow IPC tensor file per sequence
under ``seq/``. The format is documented in ``docs/trace-format.md``; only pyarrow and numpy
are needed (never torch).

Write with :class:`TraceWriter`, read with :func:`open_store`, check with
:func:`validate_store` (or ``tracesim validate DIR``).
"""

from __future__ import annotations

from .format import SCHEMA_VERSION, ModelMeta, StoreError
from .reader import TraceSequence, TraceStore, open_store
from .validate import validate_store
from .writer import SequenceWriter, TraceWriter

__all__ = [
    "SCHEMA_VERSION",
    "ModelMeta",
    "SequenceWriter",
    "StoreError",
    "TraceSequence",
    "TraceStore",
    "TraceWriter",
    "open_store",
    "validate_store",
]
