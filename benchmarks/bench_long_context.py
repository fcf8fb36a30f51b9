"""Replay memory and time of one layer at long contexts (a synthetic in-memory layer).

Builds one SmolLM2-shaped layer (9 query heads, 3 KV heads, d = 64, hidden 576, ``o_proj``)
with ``--positions`` positions in memory: random keys with a few heavy tokens, random values, 32
question-window queries and ``--decode`` decode queries at the end, and a heavy-tailed H2O
score. No stored outputs (the output check is skipped). It then replays ``--policies`` x
``--seeds`` with the output-space certificate on and prints the process's own peak RSS
(``VmHWM`` of ``/proc/self/status``, :func:`benchmarks.protocol.peak_rss_mb`) after building
the layer and after the replay. ``ru_maxrss`` would not do: Linux carries a parent's peak into
a child across fork and exec, so the figure would depend on whoever started the benchmark.

The replay holds at most :data:`tracesim.replay.engine.LOGIT_BUDGET_BYTES` of logits; what
grows with P is K, V (float64, ``n_kv x P x d x 8`` bytes each), the permanent uniforms
(``seeds x n_kv x P x 8``) and the kernels' per-thread buffers over the kept tokens; a per-step
design adds its inclusion probabilities at every step (``steps x n_kv x P x 8``) and its
proxy's cached keys.

Policies (``--policies``, comma-separated, budget 25 % throughout):

- ``SCORE:DESIGN`` (e.g. ``snapkv:poisson``, ``h2o:bernoulli``): a prefill design, one-shot
  schedule, every parameter at its default (Poisson mixture 0, SnapKV's ``last`` window).
- ``perstep:PROXY:DESIGN`` (e.g. ``perstep:quant:4:poisson``, ``perstep:simhash:10,150:poisson``):
  a per-step design (``docs/perstep.md``), score ``perstep`` with that proxy spec (which may
  hold colons and commas), schedule ``step`` (fresh uniforms), Poisson mixture 0.1 (the
  study's setting), other parameters at their defaults. It needs a stored decode query at every
  evaluated step: the layer's ``--decode`` queries sit at the consecutive positions
  ``P - decode .. P - 1``, and each is one step.

A comma followed by a digit continues the previous proxy spec (``simhash:10,150``), since no
score name starts with a digit.

Usage: ``python benchmarks/bench_long_context.py [--positions 131072] [--decode 64]
[--seeds 32] [--policies perstep:quant:4:poisson] [--json]``; run each size in a fresh process
(peak RSS is per process).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.protocol import peak_rss_mb  # noqa: E402


def long_layer(P: int, n_decode: int = 64, n_heads: int = 9, n_kv: int = 3, d: int = 64,
               hidden: int = 576, seed: int = 0):
    """A synthetic :class:`tracesim.policies.LayerTrace` with ``P`` positions (float64)."""
    from tracesim.policies import LayerTrace

    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n_kv, P, d))
    heavy = rng.choice(P, size=max(1, P // 256), replace=False)
    keys[:, heavy] *= 2.5
    keys[:, :4] *= 3.0  # sinks
    values = rng.standard_normal((n_kv, P, d))
    prompt = P - n_decode
    qpos = np.r_[prompt - 32:prompt, prompt:P].astype(np.int64)
    roles = ["question_window"] * 32 + ["decode"] * n_decode
    queries = rng.standard_normal((n_heads, qpos.size, d)) * 1.6
    h2o = rng.pareto(1.5, size=(n_heads, P)).astype(np.float32)
    o_proj = rng.standard_normal((hidden, n_heads * d)) / np.sqrt(d)
    return LayerTrace(layer=0, keys=keys, values=values, queries=queries, h2o=h2o,
                      query_positions=qpos, query_roles=roles, prompt_length=prompt,
                      question_start=prompt - 16, scale=d**-0.5, o_proj=o_proj,
                      sequence_id=f"long{P}", meta={"task": "synthetic", "correct": True})


#: Poisson mixture of the per-step spelling (the per-step study's, ``data/sweeps/perstep.yaml``).
PERSTEP_MIXTURE = 0.1
#: Budget of every spelling (a fraction of the compressible range, or of each step's cache).
BUDGET = 0.25


def split_policy_specs(text: str) -> list[str]:
    """Split ``--policies`` at its commas, except a comma followed by a digit, which belongs to
    a proxy spec (``perstep:simhash:10,150:poisson``)."""
    specs: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if specs and part[:1].isdigit():
            specs[-1] += "," + part
        elif part:
            specs.append(part)
    return specs


def policy_from_spec(spec: str):
    """The :class:`tracesim.policies.Policy` of one ``--policies`` entry (module docstring).

    Raises
    ------
    ValueError
        On a spec that is neither ``SCORE:DESIGN`` nor ``perstep:PROXY:DESIGN``.
    """
    from tracesim.policies import make_policy

    parts = spec.split(":")
    if parts[0] == "perstep":
        if len(parts) < 3:
            raise ValueError(f"policy {spec!r}: a per-step design is spelled "
                             "perstep:PROXY:DESIGN (e.g. perstep:quant:4:poisson)")
        design = parts[-1]
        params = {"mixture": PERSTEP_MIXTURE} if design == "poisson" else None
        return make_policy("perstep", design, BUDGET, schedule="step", design_params=params,
                           score_params={"proxy": ":".join(parts[1:-1])})
    if len(parts) != 2:
        raise ValueError(f"policy {spec!r}: expected SCORE:DESIGN or perstep:PROXY:DESIGN")
    return make_policy(parts[0], parts[1], BUDGET)


def parse_policies(text: str) -> list:
    """Every policy of a ``--policies`` value, in order."""
    return [policy_from_spec(s) for s in split_policy_specs(text)]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=131072)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=32)
    ap.add_argument("--policies", default="snapkv:poisson,snapkv:topk,h2o:bernoulli",
                    help="comma-separated SCORE:DESIGN or perstep:PROXY:DESIGN, budget 0.25 "
                         "(module docstring)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from tracesim.replay import ReplayOptions, replay_layer

    start = peak_rss_mb()
    # Compile (or load the cache) on a tiny layer first, so the peak is the replay's.
    pols = parse_policies(args.policies)
    replay_layer(long_layer(512, n_decode=4), pols, np.arange(2), n_layers=30)
    warm = peak_rss_mb()
    trace = long_layer(args.positions, n_decode=args.decode)
    built = peak_rss_mb()
    t = time.perf_counter()
    res = replay_layer(trace, pols, np.arange(args.seeds), n_layers=30,
                       options=ReplayOptions(output_space=True))
    wall = time.perf_counter() - t
    out = {"positions": args.positions, "decode": args.decode, "seeds": args.seeds,
           "policies": len(pols), "iterations": int(res.tables.it_cfg.size),
           "replay_s": wall, "peak_rss_mb": peak_rss_mb(), "rss_start_mb": start,
           "rss_warm_mb": warm, "rss_layer_built_mb": built,
           "finite": bool(np.isfinite(res.out[..., 0]).all()
                          and np.isfinite(res.lout[..., 0]).all()),
           "load": os.getloadavg()[0]}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"P = {out['positions']}, {out['decode']} decode queries, {out['policies']} "
              f"policies x {out['seeds']} seeds ({out['iterations']} iterations): replay "
              f"{wall:.1f} s; peak RSS {out['peak_rss_mb']:.0f} MiB (after warm-up "
              f"{warm:.0f}, with the layer built {built:.0f}); load {out['load']:.1f}")
    return out


if __name__ == "__main__":
    main()
