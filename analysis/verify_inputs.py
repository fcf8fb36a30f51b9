"""The report's side inputs verified before use, the way its results are: a trace store given
with ``--traces`` and the C0 adversary demo (``adversary.json``).

A damaged store (a manifest that breaks the store's own rules, a missing or resized sequence
file) or an adversary file holding NaN or strings would otherwise change a claim's verdict, or
stop the report with an internal error; both are refused here as one line naming the file and
the field (``docs/threat-model.md``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tracesim.errors import UsageError

__all__ = ["ADVERSARY_FIELDS", "check_adversary", "verify_traces"]

#: Fields of every ``adversary.json`` row the C0 claim reads, with their kind.
ADVERSARY_FIELDS = {"t": "number", "topk_identical": "bool", "topk_err2": "number",
                    "poisson_cert2": "number"}


def verify_traces(path: str | Path) -> None:
    """Refuse a ``--traces`` store that ``tracesim validate`` would refuse (structure, manifest
    rules, every listed file present with its recorded size; tensors are not re-hashed).

    Raises
    ------
    UsageError
        ``--traces STORE: N problem(s), first: ...``.
    """
    from tracesim.store import validate_store

    problems = validate_store(path, check_data=False)
    if problems:
        raise UsageError(f"--traces {path}: the trace store fails validation ({len(problems)} "
                         f"problem(s)), first: {problems[0]}; expected a store that "
                         "'tracesim validate' accepts")


def check_adversary(doc: Any, path: Path) -> None:
    """Refuse an ``adversary.json`` whose rows are not what ``tracesim adversary`` writes:
    every row an object with a finite number ``t``, ``topk_err2`` and ``poisson_cert2`` and a
    boolean ``topk_identical``.

    Raises
    ------
    UsageError
        Naming the file, the row and the field.
    """
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: expected a JSON object with 'rows', got "
                         f"{type(doc).__name__}")
    rows = doc.get("rows")
    if rows is None:
        return  # no demo rows: C0 is not evaluated
    if not isinstance(rows, list):
        raise UsageError(f"{path}: field 'rows' is {type(rows).__name__}, expected a list")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise UsageError(f"{path}: rows[{i}] is {type(row).__name__}, expected an object")
        for name, kind in ADVERSARY_FIELDS.items():
            v = row.get(name)
            ok = (isinstance(v, bool) if kind == "bool" else
                  not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v))
            if not ok:
                shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
                expected = "true or false" if kind == "bool" else "a finite number"
                raise UsageError(f"{path}: rows[{i}] field {name!r} is {shown}, expected "
                                 f"{expected}")
