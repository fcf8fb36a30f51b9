"""docs/replay.md's sample-store figures equal what the tool prints today.

The blocks are written by ``benchmarks/sample_store_figures.py --write``; here they are read
back from the doc and compared with fresh runs of the same commands: the whole C0 adversary
table (three seconds), and, from a one-layer run of the replay (the full one takes tens of
seconds), its policies, sequences, seeds and per-policy rows scaled by the store's layers.
"""

from __future__ import annotations

import json
import math
import re

from benchmarks.sample_store_figures import DOC, STORE, doc_block, run_block


def _doc(name: str) -> str:
    text = DOC.read_text()
    start, end = doc_block(text, name)
    return text[start:end]


def _same_token(doc: str, tool: str) -> bool:
    if doc == tool:
        return True
    try:  # printed with 4 significant digits: allow the last digit to differ
        a, b = float(doc), float(tool)
    except ValueError:
        return False
    return math.isclose(a, b, rel_tol=2e-3, abs_tol=1e-3)


def test_adversary_table_is_the_tools_output():
    doc, tool = _doc("adversary").splitlines(), run_block("adversary").splitlines()
    assert len(doc) == len(tool), (doc, tool)
    for doc_line, tool_line in zip(doc, tool, strict=True):
        doc_words, tool_words = doc_line.split(), tool_line.split()
        assert len(doc_words) == len(tool_words), (doc_line, tool_line)
        assert all(_same_token(a, b) for a, b in zip(doc_words, tool_words, strict=True)), (
            f"docs/replay.md: {doc_line!r}\n          tool: {tool_line!r}")
    # the retained hash is data, not arithmetic: exact, and the same for every t
    hashes = {line.split()[1] for line in doc if re.match(r"\s+\d+ [0-9a-f]{16} ", line)}
    assert len(hashes) == 1 and hashes <= set(" ".join(tool).split())


def _rows(block: str) -> dict[tuple[str, ...], tuple[str, int]]:
    """(score, design, corr, budget) -> (seeds, rows) of a replay summary."""
    out = {}
    for line in block.splitlines()[2:]:
        words = line.split()
        if len(words) == 13:
            out[tuple(words[:4])] = (words[11], int(words[12]))
    return out


def test_replay_table_has_the_tools_policies_and_rows():
    doc = _doc("replay")
    tool = run_block("replay", ["--layers", "0"])
    n_layers = json.loads((STORE / "model.json").read_text())["n_layers"]
    doc_rows, tool_rows = _rows(doc), _rows(tool)
    assert doc_rows.keys() == tool_rows.keys()
    summary = re.compile(r"(\d+) rows \((\d+) policies, (\d+) sequence\(s\), (\d+) seeds\)")
    doc_total, *doc_counts = summary.search(doc).groups()
    tool_total, *tool_counts = summary.search(tool).groups()
    assert doc_counts == tool_counts
    assert int(doc_total) == n_layers * int(tool_total)
    for key, (seeds, rows) in tool_rows.items():
        assert doc_rows[key] == (seeds, rows * n_layers), key
