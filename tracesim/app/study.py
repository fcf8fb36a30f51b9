"""The calibration study in one command: ``tracesim demo --scale calibration``.

Stages (each resumable, like the demo's):

1. capture SmolLM2 traces: 16 passkey + 16 multikey sequences at 1k tokens (``t1k``), and
   2 + 2 at 512 and 2k tokens and 1 + 1 at 4k for the context-length table;
2. three sweeps from the committed specs ``data/sweeps/calibration.yaml`` (main grid),
   ``calibration-pages.yaml`` (page-summary sizes 8/16/32/64) and ``calibration-length.yaml``
   (512 / 1k / 2k / 4k), with their store paths pointed at ``OUT/traces`` and written as
   ``OUT/<name>.yaml``;
3. ``tracesim frontier`` on each (``OUT/frontier-<name>``), fitting the validity rules on the
   pre-registered calibration split;
4. the report of the main sweep with the frontier and claim C8 (``OUT/report``).

The measured tables and what they mean are in ``docs/calibration.md``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml

__all__ = ["CAPTURES", "SPECS", "run_calibration_study", "study_spec"]

_ROOT = Path(__file__).resolve().parents[2]
#: (store name, tasks, instances per task, prompt length in tokens)
CAPTURES: tuple[tuple[str, tuple[str, ...], int, int], ...] = (
    ("t1k", ("passkey", "multikey"), 16, 1024),
    ("t512", ("passkey", "multikey"), 2, 512),
    ("t2k", ("passkey", "multikey"), 2, 2048),
    ("t4k", ("passkey", "multikey"), 1, 4096),
)
#: sweep name -> committed spec
SPECS = {"main": "calibration.yaml", "pages": "calibration-pages.yaml",
         "length": "calibration-length.yaml"}


def study_spec(name: str, out: Path, traces: Path) -> dict[str, Any]:
    """The committed spec ``name`` with stores under ``traces`` and output ``out/sweep-name``."""
    path = _ROOT / "data" / "sweeps" / SPECS[name]
    from tracesim.safeio import read_yaml

    spec = read_yaml(path, "committed sweep spec")
    spec["store"] = [{"path": str((traces / s["name"]).resolve()), "name": s["name"]}
                     for s in spec["store"]]
    spec["output"] = str((out / f"sweep-{name}").resolve())
    spec["prereg"] = str((_ROOT / "data" / "prereg.yaml").resolve())
    return spec


def run_calibration_study(out: str | Path = "demo/calibration", *, workers: int | None = None,
                          model: str = "smollm2", allow_prereg_change: bool = False) -> Path:
    """Run every stage; return the path of the report's ``report.html``."""
    from tracesim.analysis.frontier_cli import run_frontier
    from tracesim.analysis.report import build_report, write_report
    from tracesim.capture.runner import run_capture
    from tracesim.sweep import run_sweep

    out = Path(out)
    traces = out / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    for name, tasks, n, length in CAPTURES:
        t0 = time.perf_counter()
        print(f"\n== capture {name}: {model}, {', '.join(tasks)}, {n} each, {length} tokens ==",
              flush=True)
        s = run_capture(model, tasks, n=n, length=length, out=traces / name)
        print(f"({len(s.written)} captured, {len(s.skipped)} already there; "
              f"{time.perf_counter() - t0:.0f} s)")
    for name in SPECS:
        t0 = time.perf_counter()
        print(f"\n== sweep {name} ==", flush=True)
        spec_path = out / f"{name}.yaml"
        spec_path.write_text(yaml.safe_dump(study_spec(name, out, traces), sort_keys=False))
        summary = run_sweep(spec_path, workers=workers)
        print(f"{summary.n_rows} rows, {summary.n_configs} configurations "
              f"({time.perf_counter() - t0:.0f} s)")
        t0 = time.perf_counter()
        _, notes = run_frontier(out / f"sweep-{name}", out / f"frontier-{name}")
        print(f"frontier -> {out / f'frontier-{name}'} ({time.perf_counter() - t0:.0f} s)")
    print("\n== report ==", flush=True)
    report = build_report(out / "sweep-main", None, prereg_path=_ROOT / "data" / "prereg.yaml",
                          frontier_dir=out / "frontier-main",
                          allow_prereg_change=allow_prereg_change)
    path = write_report(report, out / "report")
    print(report.terminal_table())
    print(f"\ncalibration study finished in {time.perf_counter() - t_all:.0f} s; report: "
          f"{path.resolve()}")
    return path
