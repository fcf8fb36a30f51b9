"""Replay engine speed: numba vs a vectorized torch baseline, and useful FLOP rate vs SGEMM.

Side by side in one run, per context length, on one SmolLM2-shaped layer (9 query heads,
3 KV heads, head_dim 64, 32 decode queries) and 54 one-shot policies (6 scores x
{topk, poisson, bernoulli} x budgets {0.1, 0.25, 0.5}) x 32 seeds:

- ``numba``: :func:`tracesim.replay.replay_layer` without the output-space certificate (the
  math the torch baseline implements), and ``numba+os`` with it (the default);
- ``torch``: :mod:`benchmarks.torch_replay`, the same math vectorized in torch (float64);
- useful FLOPs: ``4 d`` per kept key the query sees (logit + weighted value) and ``2 d`` per kept
  tail key for certified policies (the certificate's pass), per query, head and seed — the
  engine shares logits across policies and seeds, so it does less than this count;
- SGEMM: numpy float32 ``4096^2`` matmul, best of 3, measured in the same run.

Results of numba and torch are checked against each other (rtol 1e-8; with ``--precision
float32`` within the float32 mode's documented tolerance). Protocol: the three
runs alternate (off, on, torch, off, on, torch, ...) for ``--rounds`` rounds (default 3); the
table shows medians and the 1-minute load average is printed beside every timing. On a shared
machine the wall-clock figures are provisional; the ``cpu-norm`` column divides by process CPU
time instead.

Usage: ``python benchmarks/bench_replay.py [--positions 1024,2048] [--seeds 32]
[--precision float32]`` (4096 works
too but the torch baseline alone then takes ~2.5 min on 2 cores)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.torch_replay import torch_replay  # noqa: E402
from tests.replay_fixtures import synthetic_trace  # noqa: E402
from tracesim.kernels import replay as K  # noqa: E402
from tracesim.policies import SCORES as SCORE_CLASSES  # noqa: E402
from tracesim.policies import make_policy  # noqa: E402
from tracesim.replay import ReplayOptions, replay_layer  # noqa: E402
from tracesim.replay.inclusion import seed_uniforms  # noqa: E402

SCORES = ("snapkv", "h2o", "tova", "knorm", "streaming", "vnorm")
DESIGNS = ("topk", "poisson", "bernoulli")
BUDGETS = (0.1, 0.25, 0.5)


def sgemm_rate(n: int = 4096, repeats: int = 3, threads: int = 2) -> tuple[float, float]:
    """GFLOP/s of a float32 n x n matmul (numpy's BLAS, all threads), best of ``repeats``:
    (wall-clock rate, CPU-normalised rate = flops / (process CPU seconds / threads))."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b
    best = best_cpu = np.inf
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        a @ b
        best = min(best, time.perf_counter() - t)
        best_cpu = min(best_cpu, (time.process_time() - c) / threads)
    return 2 * n**3 / best / 1e9, 2 * n**3 / best_cpu / 1e9


def policies() -> list:
    # The synthetic trace records 8-query windows: SnapKV reads its question-window queries.
    return [make_policy(s, d, b, design_params={"mixture": 0.1} if d == "poisson" else None,
                        score_params={"window_source": "question"} if s == "snapkv" else None)
            for s in SCORES if not SCORE_CLASSES[s].per_step for d in DESIGNS for b in BUDGETS]


def useful_flops(res, pols) -> float:
    """4 d per kept visible key (+ 2 d per kept visible tail key if certified) per row."""
    d = res.trace.keys.shape[2]
    tau = res.tables.tau[res.tables.slot_ev[res.tables.it_slot]]  # (n_iter,)
    decode_vis = res.query_positions[None, :] - tau[:, None] + 1  # (n_iter, NQ)
    kept_vis = res.out[..., K.F_KEPT] + decode_vis[:, None, :]
    cert = np.array([pols[c].certified for c in res.tables.it_cfg])[:, None, None]
    return float((4 * d * kept_vis + 2 * d * res.out[..., K.F_TAIL] * cert).sum())


def _median(xs: list[float]) -> float:
    return float(np.median(xs)) if xs else float("nan")


def _load() -> float:
    return os.getloadavg()[0]


def _check(res, ref: dict, precision: str) -> None:
    """numba against torch: to 1e-8 in float64; in float32 within the tolerance
    ``docs/replay.md`` documents (squared norms to 1e-4 |o|^2, others rtol 1e-4 + 1e-6, Wald
    coverage fractions within 0.01 on average)."""
    o2 = (res.truth_norm ** 2)[None]
    for name, f in (("err2", K.F_ERR2), ("cert2", K.F_CERT2), ("wald", K.F_WALD),
                    ("tail", K.F_TAIL), ("out_mass", K.F_OUT_MASS), ("ev_max", K.F_EV_MAX)):
        a, b = res.out[..., f], ref[name]
        if precision == "float64":
            np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-12, err_msg=name)
            continue
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"{name}: NaN pattern")
        np.testing.assert_array_equal(np.isinf(a), np.isinf(b), err_msg=f"{name}: inf pattern")
        ok = np.isfinite(b)
        if name in ("err2", "cert2"):
            worst = (np.abs(a - b) - 1e-4 * np.broadcast_to(o2, a.shape))[ok].max(initial=0.0)
            if worst > 0:
                raise AssertionError(f"{name}: beyond 1e-4 |o|^2 by {worst:.3g}")
        elif name == "wald":
            if np.abs(a - b)[ok].mean() > 0.01:
                raise AssertionError(f"{name}: mean coverage difference over 0.01")
        elif name == "tail":
            np.testing.assert_array_equal(a[ok], b[ok], err_msg=name)  # a count: exact
        else:
            np.testing.assert_allclose(a[ok], b[ok], rtol=1e-4, atol=1e-6, err_msg=name)


def run(P: int, seeds: int, with_torch: bool, rounds: int, n_queries: int = 32,
        precision: str = "float64") -> dict:
    """Alternate numba (output space off), numba (on, the default) and torch, ``rounds`` times;
    medians, with the 1-minute load average printed beside every timing."""
    trace = synthetic_trace(0, n_heads=9, n_kv=3, d=64, P=P, prompt_length=P - n_queries,
                            hidden=576)
    pols = policies()
    seed_arr = np.arange(seeds)
    for output_space in (False, True):  # load (or compile) this precision's kernels
        replay_layer(trace, pols[:4], seed_arr[:2], n_layers=30,
                     options=ReplayOptions(output_space=output_space, precision=precision))
    times: dict[str, list[float]] = {"off": [], "off_cpu": [], "os": [], "os_cpu": [],
                                     "torch": []}
    res = None
    for r in range(rounds):
        t, c = time.perf_counter(), time.process_time()
        res = replay_layer(trace, pols, seed_arr, n_layers=30,
                           options=ReplayOptions(output_space=False, precision=precision))
        times["off"].append(time.perf_counter() - t)
        times["off_cpu"].append(time.process_time() - c)
        print(f"  P={P} round {r}: numba (os off) {times['off'][-1]:.2f} s [load {_load():.1f}]",
              flush=True)
        t, c = time.perf_counter(), time.process_time()
        replay_layer(trace, pols, seed_arr, n_layers=30,
                     options=ReplayOptions(precision=precision))
        times["os"].append(time.perf_counter() - t)
        times["os_cpu"].append(time.process_time() - c)
        print(f"  P={P} round {r}: numba (os on)  {times['os'][-1]:.2f} s (CPU off "
              f"{times['off_cpu'][-1]:.2f} s, on {times['os_cpu'][-1]:.2f} s) "
              f"[load {_load():.1f}]", flush=True)
        if with_torch:
            u = seed_uniforms(seed_arr, trace.layer, trace.n_kv_heads, P)
            t = time.perf_counter()
            ref = torch_replay(trace, pols, res.tables, u)
            times["torch"].append(time.perf_counter() - t)
            print(f"  P={P} round {r}: torch          {times['torch'][-1]:.2f} s "
                  f"[load {_load():.1f}]", flush=True)
            if r == 0:
                _check(res, ref, precision)
    return {"P": P, "policies": len(pols), "seeds": seeds, "iterations": res.tables.it_cfg.size,
            "numba": _median(times["off"]), "numba_cpu": _median(times["off_cpu"]),
            "numba_os": _median(times["os"]), "numba_os_cpu": _median(times["os_cpu"]),
            "torch": _median(times["torch"]),
            "useful_gflop": useful_flops(res, pols) / 1e9, "load": _load()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", default="1024,2048")
    parser.add_argument("--seeds", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternated rounds (numba off, numba on, torch); medians")
    parser.add_argument("--torch-positions", default="1024",
                        help="contexts at which the (slow) torch baseline also runs")
    parser.add_argument("--precision", choices=("float64", "float32"), default="float64",
                        help="ReplayOptions.precision of both numba runs (the torch baseline "
                             "stays float64)")
    args = parser.parse_args()
    import numba
    import torch

    threads = numba.get_num_threads()
    torch.set_num_threads(threads)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    rates = [sgemm_rate(threads=threads)]
    with_torch = {int(p) for p in args.torch_positions.split(",") if p}
    rows = [run(int(p), args.seeds, int(p) in with_torch, args.rounds,
                precision=args.precision)
            for p in args.positions.split(",")]
    rates.append(sgemm_rate(threads=threads))
    sgemm = max(r[0] for r in rates)
    sgemm_cpu = max(r[1] for r in rates)
    print(f"numba precision {args.precision}; threads: numba {threads}, torch "
          f"{torch.get_num_threads()}; SGEMM (numpy float32 "
          f"4096^2, best of 3, before/after): {rates[0][0]:.0f} / {rates[1][0]:.0f} GFLOP/s "
          f"wall, {sgemm_cpu:.0f} GFLOP/s CPU-normalised; medians of {args.rounds} "
          f"alternated rounds")
    head = (f"{'P':>5} {'pol':>4} {'seeds':>5} {'iters':>5} {'numba s':>8} {'+os s':>7} "
            f"{'os/off':>6} {'torch s':>8} {'speedup':>8} {'useful GF':>9} {'GFLOP/s':>8} "
            f"{'% SGEMM':>8} {'cpu-norm':>8} {'%':>6} {'load':>5}")
    print(head)
    print("-" * len(head))
    for r in rows:
        rate = r["useful_gflop"] / r["numba"]
        # Rate if every thread had had a core to itself (other processes share the machine).
        cpu_rate = r["useful_gflop"] / (r["numba_cpu"] / threads)
        print(f"{r['P']:>5} {r['policies']:>4} {r['seeds']:>5} {r['iterations']:>5} "
              f"{r['numba']:>8.2f} {r['numba_os']:>7.2f} {r['numba_os'] / r['numba']:>5.2f}x "
              f"{r['torch']:>8.2f} {r['torch'] / r['numba']:>7.1f}x {r['useful_gflop']:>9.1f} "
              f"{rate:>8.1f} {100 * rate / sgemm:>7.1f}% {cpu_rate:>8.1f} "
              f"{100 * cpu_rate / sgemm_cpu:>5.1f}% {r['load']:>5.1f}")
    for r in rows:
        print(f"P={r['P']}: output space on / off by process CPU time (medians) "
              f"{r['numba_os_cpu'] / r['numba_cpu']:.2f}x")
    print("cpu-norm: useful FLOPs / (process CPU seconds / threads), i.e. the rate had the "
          "threads not shared the cores with other processes; its % is of the CPU-normalised "
          "SGEMM rate")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
