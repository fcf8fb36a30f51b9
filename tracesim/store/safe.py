"""Bounded, verifying access to the files of an untrusted trace store.

Every file of a store (``model.json``, ``manifest.parquet``, ``o_proj.arrow``, ``seq/*.arrow``)
is opened through :func:`member_file`: it must be a regular file that resolves inside the
store (no FIFO, device, socket or symlink escape), so nothing read from a stranger's store can
hang a reader or read without bound. JSON documents are read by :func:`read_json_bounded`
with a size limit and :func:`tracesim.safeio.loads_json` (nesting depth scanned before
parsing, a key given twice refused); ``model.json`` by :func:`parse_model_json`, which then
checks it (:func:`tracesim.store.format.check_model_doc`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from .format import MODEL_FILE, ModelMeta, StoreError, check_model_doc

__all__ = ["MAX_JSON_BYTES", "MAX_JSON_DEPTH", "json_depth", "member_file", "parse_model_json",
           "read_json_bounded", "read_model_json"]

#: Largest ``model.json`` accepted (bytes).
MAX_JSON_BYTES = 1 << 20
#: Deepest nesting of JSON objects/arrays accepted in store metadata.
MAX_JSON_DEPTH = 32


def member_file(root: Path, rel: str, label: str | None = None) -> os.stat_result:
    """Check that ``root / rel`` is a regular file inside ``root``; return its ``stat``.

    Raises
    ------
    FileNotFoundError
        If it does not exist (callers word their own "missing" message).
    StoreError
        If it is a FIFO, device, socket or directory, or a symlink leading outside ``root``.
    """
    label = label or rel
    path = Path(root) / rel
    st = os.lstat(path)  # FileNotFoundError propagates
    if stat.S_ISLNK(st.st_mode):
        try:
            target = path.resolve(strict=True)
        except (OSError, RuntimeError):
            raise StoreError(f"{label}: is a dangling or looping symlink, expected a regular "
                             "file inside the store") from None
        if not target.is_relative_to(Path(root).resolve()):
            raise StoreError(f"{label}: is a symlink to {target}, outside the store, expected "
                             "a regular file inside the store")
        st = os.stat(target)
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if
                stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a directory"
                if stat.S_ISDIR(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "not a regular file")
        raise StoreError(f"{label}: is {kind}, expected a regular file")
    return st


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (iterative: no recursion limit)."""
    depth, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            depth = max(depth, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return depth


def loads_bounded(data: bytes | str, label: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """:func:`tracesim.safeio.loads_json` (depth scanned before parsing, duplicate keys
    refused) raising :class:`StoreError` naming ``label``."""
    from tracesim.safeio import loads_json

    return loads_json(data, label, max_depth, error=StoreError)


def read_json_bounded(root: Path, rel: str, max_bytes: int = MAX_JSON_BYTES,
                      max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Read the JSON file ``root / rel`` with size and depth limits.

    Raises
    ------
    FileNotFoundError
        If missing.
    StoreError
        If not a regular file inside the store, larger than ``max_bytes``, not UTF-8 JSON, or
        nested deeper than ``max_depth``.
    """
    st = member_file(root, rel)
    if st.st_size > max_bytes:
        raise StoreError(f"{rel}: file has {st.st_size} bytes, expected at most {max_bytes}")
    with open(Path(root) / rel, "rb") as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise StoreError(f"{rel}: file has more than {max_bytes} bytes, expected at most "
                         f"{max_bytes}")
    return loads_bounded(data, rel, max_depth)


def parse_model_json(root: Path) -> tuple[ModelMeta | None, dict[str, Any], list[str]]:
    """Read ``model.json``; return ``(model or None, raw dict, problems)``."""
    try:
        raw = read_json_bounded(root, MODEL_FILE)
    except FileNotFoundError:
        return None, {}, [f"{MODEL_FILE}: missing (not a trace store?)"]
    except StoreError as exc:
        return None, {}, [str(exc)]
    except OSError as exc:
        return None, {}, [f"{MODEL_FILE}: unreadable ({exc})"]
    if not isinstance(raw, dict):
        return None, {}, [f"{MODEL_FILE}: expected a JSON object, got {type(raw).__name__}"]
    model, problems = check_model_doc(raw)
    return model, raw, problems


def read_model_json(root: Path) -> tuple[ModelMeta, dict[str, Any]]:
    """Read and check ``model.json``; raise :class:`StoreError` on any problem."""
    model, raw, problems = parse_model_json(root)
    if problems or model is None:
        raise StoreError(f"{root}: " + "; ".join(problems))
    return model, raw
