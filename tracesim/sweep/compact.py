"""Small pieces of the sweep's last step: the summary's name, the task-set digest, JSON writes.

The results themselves are published as a dataset of parts (:mod:`tracesim.sweep.dataset`);
earlier versions compacted them into one ``results/results.parquet``, which every reader still
reads.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tracesim.atomic import atomic_write_bytes
from tracesim.sweep.tasks import Task

__all__ = ["SUMMARY_FILE", "tasks_digest", "write_json"]

SUMMARY_FILE = "results/summary.json"


def tasks_digest(tasks: Sequence[Task]) -> str:
    """sha256 of the sorted task keys: identifies the exact set of task files published."""
    return hashlib.sha256("\n".join(sorted(t.key for t in tasks)).encode()).hexdigest()


def write_json(path: Path, doc: Any) -> None:
    """Write JSON atomically (temp + fsync + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode(),
                       unique=True)
