"""One bounded reader for every file tracesim reads from a user or a stranger.

Specs, grids, pre-registrations, prompts files, validity rules and the JSON documents inside
stores and results directories all come through here, so the same rules hold everywhere
(``docs/threat-model.md``):

- only regular files: a FIFO, a device (``/dev/zero``), a socket, a directory or anything
  under ``/proc`` or ``/sys`` is refused with its path named, before a byte is read (the file
  is opened ``O_NONBLOCK`` so that opening a FIFO cannot block either);
- a size limit checked with ``fstat`` before reading and enforced while reading (at most
  ``limit + 1`` bytes are ever read, so a file that grows or lies about its size is caught);
- YAML through :class:`BoundedLoader` (``yaml.SafeLoader`` without aliases, so no "billion
  laughs"; duplicate keys refused with the key and line named; nesting depth limited before
  the recursive composer can raise ``RecursionError``);
- JSON with duplicate keys refused and its nesting depth measured by a scan of the text before
  ``json.loads`` recurses.

Every refusal is raised as ``error`` (default :class:`~tracesim.errors.UsageError`), a
``ValueError`` whose message names the file and what was expected; ``tracesim`` prints it as
one line and exits 2.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any

import yaml

from tracesim.errors import UsageError

__all__ = ["MAX_DEPTH", "MAX_HASH_BYTES", "MAX_JSON_BYTES", "MAX_YAML_BYTES", "BoundedLoader",
           "PyBoundedLoader", "hash_file", "json_text_depth", "loads_json", "loads_yaml",
           "read_bytes", "read_json", "read_text", "read_yaml", "regular_file",
           "scan_yaml_events"]

#: Largest YAML document accepted (bytes): specs are a few kB; pure-Python YAML parses ~1 MB/s.
MAX_YAML_BYTES = 1 << 20
#: Largest JSON document accepted by default (bytes).
MAX_JSON_BYTES = 16 << 20
#: Deepest nesting of mappings/lists accepted by default (specs need about 6).
MAX_DEPTH = 32
#: Largest file hashed by :func:`hash_file` by default (pre-registrations, specs).
MAX_HASH_BYTES = 64 << 20

ErrorType = type[Exception]


def _pseudo_fs_devices() -> set[int]:
    """``st_dev`` of /proc and /sys: their "regular" files have no honest size."""
    out = set()
    for root in ("/proc", "/sys"):
        try:
            out.add(os.stat(root).st_dev)
        except OSError:
            pass
    return out


_PSEUDO_DEVS = _pseudo_fs_devices()


def _kind(mode: int) -> str:
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode)
            or stat.S_ISBLK(mode) else "a directory" if stat.S_ISDIR(mode) else "a socket"
            if stat.S_ISSOCK(mode) else "not a regular file")


def _open_error(path: Path, exc: OSError, what: str, error: ErrorType) -> Exception:
    if exc.errno == errno.ELOOP:
        reason = "a symlink loop"
    else:
        reason = exc.strerror or str(exc)
    return error(f"{path}: cannot read the {what} ({reason}), expected a readable regular file")


def _check_stat(path: Path, st: os.stat_result, what: str, limit: int | None,
                error: ErrorType) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: is {_kind(st.st_mode)}, expected the {what} as a regular file")
    # by device and by path: mounts below /proc (binfmt_misc, ...) have devices of their own
    if st.st_dev in _PSEUDO_DEVS or os.path.realpath(path).startswith(("/proc/", "/sys/")):
        raise error(f"{path}: lies in /proc or /sys, expected the {what} as a regular file")
    if limit is not None and st.st_size > limit:
        raise error(f"{path}: the {what} has {st.st_size} bytes, expected at most {limit}")


def regular_file(path: str | os.PathLike, what: str = "file", limit: int | None = None,
                 error: ErrorType = UsageError) -> os.stat_result:
    """``stat`` of ``path`` after checking it is a regular file of at most ``limit`` bytes.

    Symlinks are followed (a loop is refused); nothing is opened.

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist (callers word their own "missing" message).
    error
        If it is not a regular file, lies in /proc or /sys, or is larger than ``limit``.
    """
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _open_error(path, exc, what, error) from None
    _check_stat(path, st, what, limit, error)
    return st


def _open(path: Path, what: str, limit: int | None, error: ErrorType) -> int:
    """A file descriptor of a checked regular file (the caller closes it)."""
    # stat first: a device is refused without being opened (opening some has side effects)
    regular_file(path, what, limit, error)
    try:
        # O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _open_error(path, exc, what, error) from None
    try:  # again on the descriptor: the path may have been swapped since the stat
        _check_stat(path, os.fstat(fd), what, limit, error)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: str | os.PathLike, limit: int, what: str = "file",
               error: ErrorType = UsageError) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (at most ``limit + 1`` are read).

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    error
        Not a regular file, in /proc or /sys, larger than ``limit``, or unreadable.
    """
    path = Path(path)
    fd = _open(path, what, limit, error)
    try:
        with os.fdopen(fd, "rb", closefd=True) as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise _open_error(path, exc, what, error) from None
    if len(data) > limit:  # the file grew after fstat
        raise error(f"{path}: the {what} has more than {limit} bytes, expected at most {limit}")
    return data


def read_text(path: str | os.PathLike, limit: int, what: str = "file",
              error: ErrorType = UsageError) -> str:
    """UTF-8 text of a regular file (see :func:`read_bytes`); bad bytes are refused."""
    data = read_bytes(path, limit, what, error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: byte {exc.start} is not UTF-8, expected the {what} as UTF-8 "
                    "text") from None


def hash_file(path: str | os.PathLike, limit: int | None = MAX_HASH_BYTES,
              what: str = "file", error: ErrorType = UsageError) -> str:
    """``sha256:<hex>`` of a regular file, read in 1 MiB blocks; at most ``limit`` bytes."""
    path = Path(path)
    fd = _open(path, what, limit, error)
    h, seen = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "rb", closefd=True) as fh:
            while block := fh.read(1 << 20):
                seen += len(block)
                if limit is not None and seen > limit:
                    raise error(f"{path}: the {what} has more than {limit} bytes, expected "
                                f"at most {limit}")
                h.update(block)
    except OSError as exc:
        raise _open_error(path, exc, what, error) from None
    return "sha256:" + h.hexdigest()


# --------------------------------------------------------------------------- JSON

# A JSON string (skipped, brackets inside do not count) or one bracket.
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.S)


def json_text_depth(text: str) -> int:
    """Deepest bracket nesting of a JSON text, by a linear scan (no recursion, no parse)."""
    depth = best = 0
    for m in _JSON_TOKENS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            best = max(best, depth)
        elif c in "]}":
            depth -= 1
    return best


def loads_json(data: bytes | str, label: str, max_depth: int = MAX_DEPTH,
               error: ErrorType = UsageError, intern: bool = False) -> Any:
    """Parse JSON text: depth at most ``max_depth``, no key twice in one object.

    ``label`` names the file (or ``file:line``, or the field) in messages. With ``intern``,
    the strings of each list of strings are interned as their object is parsed (a manifest
    repeating the same configuration ids in every part then holds each id once).
    """
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"{label}: byte {exc.start} is not UTF-8, expected UTF-8 JSON") from None
    depth = json_text_depth(data)
    if depth > max_depth:
        raise error(f"{label}: JSON nesting is {depth} levels deep, expected at most "
                    f"{max_depth}")

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise error(f"{label}: key {key!r} appears twice in one JSON object, expected "
                            "each key once")
            if intern and isinstance(value, list) and value and all(
                    isinstance(v, str) for v in value):
                value = [sys.intern(v) for v in value]
            out[key] = value
        return out

    try:
        return json.loads(data, object_pairs_hook=pairs)
    except RecursionError:  # pragma: no cover - the scan above refuses deep texts first
        raise error(f"{label}: JSON nesting is too deep, expected at most {max_depth} "
                    "levels") from None
    except json.JSONDecodeError as exc:
        raise error(f"{label}: not valid JSON ({exc.msg} at line {exc.lineno} column "
                    f"{exc.colno}), expected a JSON document") from None
    except ValueError as exc:
        if isinstance(exc, error):
            raise
        raise error(f"{label}: unreadable JSON ({str(exc)[:200]}), expected a JSON "
                    "document") from None


def read_json(path: str | os.PathLike, what: str = "JSON file", limit: int = MAX_JSON_BYTES,
              max_depth: int = MAX_DEPTH, error: ErrorType = UsageError,
              intern: bool = False) -> Any:
    """Read a JSON file through :func:`read_bytes` and :func:`loads_json`."""
    return loads_json(read_bytes(path, limit, what, error), str(path), max_depth, error,
                      intern)


# --------------------------------------------------------------------------- YAML


_LOADER_BASE = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: ~10x faster


def _node_path(path: list[str]) -> str:
    text = "".join(path).lstrip(".")
    return text if len(text) <= 80 else text[:36] + "..." + text[-40:]  # names the field


def scan_yaml_events(loader: Any, label: str, max_depth: int = MAX_DEPTH,
                     error: ErrorType = UsageError) -> None:
    """Walk a YAML event stream once, before anything is composed: refuse any alias and any
    nesting deeper than ``max_depth``, naming the key path (``grid.score[2]``) and the line.

    Aliases are refused outright rather than counted: a spec never needs one, and a count
    cannot tell a harmless alias from the first step of an exponential expansion. The walk
    keeps an explicit stack, so no depth can raise ``RecursionError``.
    """
    # one frame per open collection: [is_mapping, expecting_key, key or index, is_a_value]
    stack: list[list[Any]] = []
    path: list[str] = []

    def where() -> str:
        text = _node_path(path)
        return f"{label}: {text}: " if text else f"{label}: "

    def enter_node() -> bool:
        """Position of the node starting now; False if it is a mapping key."""
        if not stack:
            return True
        top = stack[-1]
        if top[0] and top[1]:
            return False
        path.append(f".{str(top[2])[:40]}" if top[0] else f"[{top[2]}]")
        return True

    def leave_node(was_value: bool) -> None:
        if not stack:
            return
        top = stack[-1]
        if top[0]:
            top[1] = not top[1]
        else:
            top[2] += 1
        if was_value:
            path.pop()

    while True:
        try:
            event = loader.get_event()
        except yaml.MarkedYAMLError as exc:
            if "nesting depth" not in str(exc):  # libyaml's own limit (1000 levels)
                raise
            if stack and stack[-1][0] and not stack[-1][1]:
                path.append(f".{str(stack[-1][2])[:40]}")  # the key whose value is too deep
            line = exc.problem_mark.line + 1 if exc.problem_mark else "?"
            raise error(f"{where()}line {line}: YAML nesting is deeper than {max_depth} "
                        f"levels, expected at most {max_depth}") from None
        if event is None or isinstance(event, yaml.StreamEndEvent):
            return
        if isinstance(event, yaml.AliasEvent):
            enter_node()
            raise error(f"{where()}line {event.start_mark.line + 1}: YAML alias "
                        f"*{event.anchor} is not accepted, expected every value written out "
                        "(no anchors or aliases)")
        if isinstance(event, yaml.ScalarEvent):
            if stack and stack[-1][0] and stack[-1][1]:
                stack[-1][2] = event.value  # a mapping key: the name of the next value
                stack[-1][1] = False
                continue
            leave_node(enter_node())
        elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            was_value = enter_node()
            if len(stack) >= max_depth:
                raise error(f"{where()}line {event.start_mark.line + 1}: YAML nesting is "
                            f"deeper than {max_depth} levels, expected at most {max_depth}")
            is_map = isinstance(event, yaml.MappingStartEvent)
            stack.append([is_map, is_map, 0, was_value])
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            frame = stack.pop()
            leave_node(frame[3])


# merge (``<<``) and value (``=``) keys are resolved by flatten_mapping, not constructed
_SPECIAL_KEYS = ("tag:yaml.org,2002:merge", "tag:yaml.org,2002:value")


class _NoDuplicateKeys:
    """Constructor mixin: a mapping key given twice is refused, naming the key and both lines
    (``yaml.safe_load`` would silently keep the last)."""

    label = "<yaml>"
    error: ErrorType = UsageError

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:  # noqa: D102
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag in _SPECIAL_KEYS:
                continue  # non-scalar keys are refused by the constructor (unhashable)
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # unhashable: the constructor refuses it below
                continue
            if first is not None:
                raise self.error(f"{self.label}: line {line}: key {key!r} appears twice "
                                 f"(first on line {first}), expected each key once")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)  # type: ignore[misc]


class BoundedLoader(_NoDuplicateKeys, _LOADER_BASE):  # type: ignore[misc, valid-type]
    """``yaml.SafeLoader`` (libyaml's when available) that refuses duplicate mapping keys.
    Aliases and depth are refused by :func:`scan_yaml_events` before this loader composes
    anything (:func:`loads_yaml`)."""


class PyBoundedLoader(_NoDuplicateKeys, yaml.SafeLoader):
    """The pure-Python :class:`BoundedLoader` (what runs where libyaml is not installed)."""


def loads_yaml(text: str, label: str, max_depth: int = MAX_DEPTH,
               error: ErrorType = UsageError, loader_class: type | None = None) -> Any:
    """Parse one YAML document: events scanned first (:func:`scan_yaml_events`: no alias, at
    most ``max_depth`` levels), then loaded by ``loader_class`` (default
    :class:`BoundedLoader`; no duplicate key)."""
    for step in ("scan", "load"):
        loader = (loader_class or BoundedLoader)(text)
        loader.label, loader.error = label, error
        try:
            if step == "scan":
                scan_yaml_events(loader, label, max_depth, error)
            else:
                return loader.get_single_data()
        except yaml.YAMLError as exc:  # PyYAML's messages span lines: one line here
            raise error(f"{label}: not valid YAML: {' '.join(str(exc).split())[:300]}, "
                        "expected a YAML document") from None
        except RecursionError:  # pragma: no cover - the scan refuses deep documents first
            raise error(f"{label}: YAML nesting is too deep, expected at most {max_depth} "
                        "levels") from None
        finally:
            loader.dispose()
    raise AssertionError("unreachable")  # pragma: no cover


def read_yaml(path: str | os.PathLike, what: str = "YAML file", limit: int = MAX_YAML_BYTES,
              max_depth: int = MAX_DEPTH, error: ErrorType = UsageError) -> Any:
    """Read a YAML file through :func:`read_text` and :func:`loads_yaml`."""
    return loads_yaml(read_text(path, limit, what, error), str(path), max_depth, error)
