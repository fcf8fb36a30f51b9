"""docs/replay.md's figures for the sample store, printed by the commands the doc shows.

The doc's two output blocks for ``data/sample-traces`` (the replay summary of "Measured
figures" and the C0 adversary table) are this script's output, not typed:

    python benchmarks/sample_store_figures.py           # print both blocks
    python benchmarks/sample_store_figures.py --write   # replace them in docs/replay.md

Each block follows a ``<!-- sample-figures: NAME -->`` line of the doc. The replay's wall time
and output path are left out of the block (times belong to the benchmarks, with their load).
``tests/test_sample_figures.py`` checks the doc against the tool on every CI run: the whole
adversary table, and the replay's policies, sequences, seeds and rows from a one-layer run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORE = ROOT / "data" / "sample-traces"
DOC = ROOT / "docs" / "replay.md"

# the commands docs/replay.md shows, without their --out (each runs into a temporary directory)
COMMANDS = {
    "replay": ["replay", "data/sample-traces", "--score", "snapkv,h2o",
               "--design", "topk,poisson,bernoulli", "--budget", "0.1,0.25,0.5",
               "--seeds", "64", "--window", "8", "--mixture", "0.1", "--no-progress"],
    "adversary": ["adversary", "data/sample-traces", "--score", "snapkv", "--budget", "0.25",
                  "--window", "8"],
}
_TIMING = re.compile(r"\) in [0-9.]+ s( -> .*)?$")
_WRITTEN = re.compile(r"; written to .*$")


def run_block(name: str, extra: list[str] | None = None) -> str:
    """The stdout of the doc's command ``name`` on the sample store, as the doc shows it."""
    from tracesim.app.cli import main as cli_main

    argv = [str(STORE) if arg == "data/sample-traces" else arg for arg in COMMANDS[name]]
    with tempfile.TemporaryDirectory() as tmp:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = cli_main([*argv, *(extra or []), "--out", str(Path(tmp) / "out")])
    if code != 0:
        raise RuntimeError(f"tracesim {name} exited {code}")
    lines = [line.rstrip() for line in out.getvalue().splitlines() if line.strip()]
    lines = [_WRITTEN.sub("", _TIMING.sub(")", line)) for line in lines]
    return "\n".join(lines) + "\n"


def doc_block(text: str, name: str) -> tuple[int, int]:
    """Character span of the body of the fenced block after ``<!-- sample-figures: name -->``."""
    marker = text.index(f"<!-- sample-figures: {name} -->")
    start = text.index("```\n", marker) + len("```\n")
    return start, text.index("```", start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the blocks in docs/replay.md")
    args = parser.parse_args(argv)
    text = DOC.read_text()
    for name in COMMANDS:
        block = run_block(name)
        print(f"== {name}\n{block}")
        if args.write:
            start, end = doc_block(text, name)
            text = text[:start] + block + text[end:]
    if args.write:
        DOC.write_text(text)
        print(f"wrote {DOC.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
