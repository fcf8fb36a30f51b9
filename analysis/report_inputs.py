"""The results inputs of one ``tracesim report`` call: the first (``RESULTS``, which the claims
read) and any further ones (``--results DIR``, descriptive: a per-step section each).

Every input is opened and verified as the first is (:func:`tracesim.analysis.aggregate.
open_results`: manifest and parts, ``--trust-unsigned``, the pre-registration hash), and is
named in the provenance header by its directory, sweep, row count and sha256. Two inputs that
are the same results (the same directory, or the same sha256 of their manifest or results
file) are refused: a report that listed one study twice would look like two.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracesim.analysis.aggregate import ResultsDataset, open_results
from tracesim.analysis.prereg import PreregChangedError, Preregistration, check_prereg_hash

from tracesim.errors import UsageError

__all__ = ["ResultsInput", "describe_input", "open_further_results", "recorded_prereg_hash",
           "results_sha256"]

#: Columns without which an output is not a replay or sweep's results (a ``tracesim peers``
#: or ``tracesim evict`` output has other columns: it goes to ``--peers`` or OUTCOMES).
RESULT_KEY_COLUMNS = ("config_id", "score", "design", "sequence_id", "err2")


@dataclass
class ResultsInput:
    """One verified results input of a report."""

    directory: Path
    dataset: ResultsDataset
    sha256: str
    sweep: str

    @property
    def label(self) -> str:
        """``DIR (sweep NAME)``: what the report calls this input."""
        return f"{self.directory.name} (sweep {self.sweep})"

    @property
    def slug(self) -> str:
        """The input's directory name as a figure file name may hold it."""
        return re.sub(r"[^A-Za-z0-9._-]+", "_", self.directory.name) or "results"


def recorded_prereg_hash(summary: dict[str, Any] | None) -> str | None:
    """The pre-registration sha256 a results or outcomes summary records (None: none)."""
    if not summary:
        return None
    pre = summary.get("prereg")
    return pre.get("sha256") if isinstance(pre, dict) else summary.get("prereg_sha256")


def results_sha256(directory: str | Path, dataset: ResultsDataset) -> str:
    """The sha256 of the input's manifest (a results dataset) or results file, as its summary
    records it, else computed from the file (unsigned results)."""
    from tracesim.analysis.results_io import RESULT_FILES

    from tracesim.digests import sha256_file

    recorded = (dataset.summary or {}).get("results_sha256")
    if isinstance(recorded, str) and recorded:
        return recorded
    for name in RESULT_FILES:
        if (Path(directory) / name).is_file():
            return sha256_file(Path(directory) / name, "results file")
    return "unknown"


def describe_input(directory: str | Path, dataset: ResultsDataset) -> ResultsInput:
    """A verified dataset as a :class:`ResultsInput` (its sha256 and sweep name)."""
    summary = dataset.summary or {}
    sweep = summary.get("name") if isinstance(summary.get("name"), str) else None
    return ResultsInput(Path(directory), dataset, results_sha256(directory, dataset),
                        sweep or "unnamed")


def _check_is_results(directory: Path, dataset: ResultsDataset) -> None:
    lacking = [c for c in RESULT_KEY_COLUMNS if c not in dataset]
    if lacking:
        raise UsageError(f"--results {directory}: not the results of a replay or sweep (no "
                         f"column {lacking[0]!r}); a tracesim peers output goes to --peers, an "
                         "evict output is OUTCOMES")


def open_further_results(directories: Sequence[str | Path], first: ResultsInput, *,
                         prereg: Preregistration, allow_prereg_change: bool,
                         trust_unsigned: bool, scheduler: str | None,
                         notes: list[str]) -> list[ResultsInput]:
    """Open and verify each ``--results`` directory as the first input is opened, check its
    pre-registration hash, and refuse an input given twice (``UsageError`` naming both).
    Warnings (unsigned results, an unrecorded or changed pre-registration) go to ``notes``,
    each naming its input."""
    inputs = [first]
    for d in directories:
        path = Path(d)
        if not path.is_dir():
            raise UsageError(f"--results {path}: no such directory")
        for seen in inputs:
            if path.resolve() == seen.directory.resolve():
                raise UsageError(f"--results {path}: the same directory as {seen.directory}; "
                                 "give each results input once")
        found: list[str] = []
        try:
            ds = open_results(path, trust_unsigned=trust_unsigned, notes=found,
                              scheduler=scheduler)
        except ValueError as exc:
            msg = str(exc)
            raise UsageError(msg if str(path) in msg else f"--results {path}: {msg}") from exc
        _check_is_results(path, ds)
        new = describe_input(path, ds)
        for seen in inputs:
            if new.sha256 != "unknown" and new.sha256 == seen.sha256:
                raise UsageError(f"--results {path}: the same results as {seen.directory} "
                                 f"({new.sha256}); give each results input once")
        notes += [f"{path.name}: {n}" for n in found]
        recorded = recorded_prereg_hash(ds.summary)
        if recorded is None:
            notes.append(f"{path.name}: the summary records no pre-registration; its per-step "
                         "section is descriptive either way")
            prereg_matches = True
        else:
            try:
                prereg_matches = check_prereg_hash(prereg, recorded,
                                                allow_change=allow_prereg_change)
            except PreregChangedError as exc:  # name the input: the first may be unchanged
                raise PreregChangedError(f"--results {path}: {exc}") from exc
        if not prereg_matches:
            notes.append(f"{path.name}: the pre-registration changed after these results were "
                         "produced; reported anyway because --allow-prereg-change was given")
        inputs.append(new)
    return inputs[1:]
