"""A source rule for tracesim's parallel kernels: no field of an argument is read inside a
``prange`` body.

Twice numba's parfor pass silently dropped stores made inside a parallel loop that read a named
tuple's fields there: in ``kernels/attention.py`` (some rows' results lost) and in a first
version of the output-space packs of ``kernels/replay.py`` (every layer error left NaN). Both
kernels now unpack the fields before the loop, or call a compiled function that does. The
rule checks every ``@nb.njit(parallel=True)`` function of the package by its syntax tree:
inside a ``prange`` loop, an attribute of a parameter may only be array metadata (``shape``,
``size``, ``dtype``, ``ndim``). A test that can fail: the second case below is the inline pack.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARRAY_METADATA = {"shape", "size", "dtype", "ndim"}


def _parallel(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Call) and any(
        k.arg == "parallel" and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in d.keywords) for d in fn.decorator_list)


def field_reads_in_prange(source: str) -> list[str]:
    """``"line: function: parameter.field"`` for every field of a parameter read inside a
    ``prange`` loop of a parallel function in ``source``."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef) or not _parallel(fn):
            continue
        params = {a.arg for a in fn.args.args}
        for loop in ast.walk(fn):
            if not (isinstance(loop, ast.For) and isinstance(loop.iter, ast.Call)
                    and getattr(loop.iter.func, "attr", getattr(loop.iter.func, "id", ""))
                    == "prange"):
                continue
            for stmt in loop.body:
                for node in ast.walk(stmt):
                    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                            and node.value.id in params and node.attr not in ARRAY_METADATA):
                        found.append(f"{node.lineno}: {fn.name}: {node.value.id}.{node.attr}")
    return found


def test_no_parallel_kernel_reads_an_argument_field_inside_prange():
    found, kernels = [], 0
    for path in sorted((ROOT / "tracesim").rglob("*.py")):
        text = path.read_text()
        if "prange" in text:
            found += [f"{path.relative_to(ROOT)}:{f}" for f in field_reads_in_prange(text)]
            kernels += sum(1 for fn in ast.walk(ast.parse(text))
                           if isinstance(fn, ast.FunctionDef) and _parallel(fn))
    assert kernels >= 10  # the rule read the package's parallel kernels (13 when written)
    assert found == [], "\n".join(found)


def test_the_rule_catches_the_inline_pack_and_passes_its_replacement():
    inline = '''
@nb.njit(cache=True, parallel=True)
def kernel(layer, res, pstart):
    for pk in nb.prange(pstart.size - 1):
        width = pstart[pk + 1] - pstart[pk]
        for j in range(width):
            res.lout[pstart[pk] + j, 0] = 1.0
'''
    called = '''
@nb.njit(cache=True, parallel=True)
def kernel(layer, res, pstart):
    for pk in nb.prange(pstart.size - 1):
        _pack(layer, res, pstart[pk], pstart[pk + 1])
'''
    assert field_reads_in_prange(inline) == ["7: kernel: res.lout"]
    assert field_reads_in_prange(called) == []
