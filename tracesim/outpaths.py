"""One guard for output paths: no command writes over its own inputs or someone else's data.

Every subcommand that writes (``replay``, ``sweep``, ``tiers``, ``frontier``, ``report``,
``adversary``, ``evict``, ``synth``, ``export``) calls :func:`check_output` before it creates
anything. It refuses

- an empty path (``--out ''`` would otherwise mean the working directory);
- an output that *is*, *contains* or *lies inside* an input directory (a trace store, a
  results directory), or that is or contains an input file (a spec, a pre-registration);
  symlinks are resolved first, so a link to the store is the store;
- an output inside any trace store, even one the command does not read.

Directories the tools create carry a marker file, :data:`MARKER`, naming the tool. A command
that replaces a whole directory (``export --overwrite``) replaces only a directory that carries
its marker (:func:`check_replaceable`): ``--overwrite`` never deletes a trace store, a results
directory or anything the tool did not write.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from tracesim.errors import UsageError

__all__ = ["MARKER", "check_output", "check_replaceable", "mark_output", "marked_by"]

#: Marker file written into every directory a tracesim command creates as a whole.
MARKER = ".tracesim-output"

ErrorType = type[Exception]
Inputs = Iterable[tuple[str, "str | os.PathLike[str] | None"]]


def _resolved(path: str | os.PathLike[str]) -> Path:
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError):  # a symlink loop: compare the absolute path instead
        return Path(os.path.abspath(path))


def check_output(out: str | os.PathLike[str] | None, inputs: Inputs = (),
                 option: str = "--out", error: ErrorType = UsageError) -> Path:
    """Refuse an empty output path and one that overlaps an input; return ``Path(out)``.

    Parameters
    ----------
    out : path
        The output directory (or file) the command will write.
    inputs : iterable of (label, path)
        What the command reads: directories (stores, results) and files (specs). ``None``
        paths are skipped.
    option : str
        How the output was given, for messages (``--out``, ``output``).
    error : exception type
        Raised with a one-line message naming ``option``, the input and what was expected.
    """
    if out is None or not str(out).strip():
        raise error(f"{option}: is empty, expected an output directory path")
    o = _resolved(out)
    for label, path in inputs:
        if path is None or not str(path):
            continue
        i = _resolved(path)
        if o == i:
            rel = "is"
        elif i.is_relative_to(o):
            rel = "contains"
        elif o.is_relative_to(i) and not i.is_file():
            rel = "lies inside"
        else:
            continue
        raise error(f"{option} {out}: {rel} the {label} {path}, expected an output apart from "
                    "every input (writing there would overwrite what is read)")
    store = _enclosing_store(o)
    if store is not None:
        raise error(f"{option} {out}: lies inside the trace store {store}, expected an output "
                    "outside every trace store")
    return Path(out)


def _enclosing_store(path: Path) -> Path | None:
    """The trace store (a directory with model.json and manifest.parquet) strictly above
    ``path``, even one the command does not read: nothing is ever written into a store."""
    for parent in path.parents:
        if (parent / "model.json").is_file() and (parent / "manifest.parquet").is_file():
            return parent
    return None


def mark_output(directory: str | os.PathLike[str], tool: str) -> None:
    """Write :data:`MARKER` (``{"tool": ...}``) into ``directory`` if it is not there yet."""
    path = Path(directory) / MARKER
    if not path.exists():
        from tracesim.atomic import atomic_write_text

        atomic_write_text(path, json.dumps({"tool": tool}) + "\n")


def marked_by(directory: str | os.PathLike[str]) -> str | None:
    """The tool named by ``directory``'s marker, or None (no marker, or an unreadable one)."""
    from tracesim.safeio import read_json

    path = Path(directory) / MARKER
    try:
        doc = read_json(path, "output marker", limit=4096, max_depth=2)
    except (OSError, ValueError):
        return None
    return doc.get("tool") if isinstance(doc, dict) and isinstance(doc.get("tool"), str) \
        else None


def check_replaceable(out: str | os.PathLike[str], tool: str, option: str = "--out",
                      error: ErrorType = UsageError) -> None:
    """Before replacing the existing directory ``out`` as a whole: it must carry ``tool``'s
    marker (written by :func:`mark_output`), so ``--overwrite`` replaces only what the tool
    itself wrote."""
    p = Path(out)
    if p.is_symlink() or not p.is_dir():
        raise error(f"{option} {out}: exists and is not a directory written by tracesim "
                    f"{tool}, expected a new path or an earlier {tool} output")
    if marked_by(p) != tool:
        raise error(f"{option} {out}: --overwrite replaces only a directory written by "
                    f"tracesim {tool} (it has no {MARKER} marker of {tool}), expected a new "
                    "path or an earlier output of the same command")
