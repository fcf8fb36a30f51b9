"""Cost of the serving-time certificate relative to the decode attention call it accompanies.

One decode query at a serving size (default Llama-shaped: 32 query heads sharing 8 KV heads,
32,768 cached tokens, head_dim 128, a Poisson design keeping about 25% of the cache). Variants:

* ``attention``: plain attention with the Hájek bias (one matmul, softmax, one matmul): the
  attention call;
* ``onepass, no certificate``: :func:`tracesim.capture.inloop.onepass.onepass_attention` without
weights;
* ``onepass + certificate``: output and the primary certificate in one pass;
* ``onepass + certificate + layer``: also the output-space (GQA) certificate (pair forms cached
  per plan, as :class:`tracesim.capture.inloop.enforce.EvictionState` does);
* ``two-pass``: the attention call followed by
:func:`tracesim.capture.inloop.enforce.serving_certificates`
  (the previous serving path; it recomputes the attention).

Protocol: the variants alternate (A, B, C, ... then again) for ``--rounds`` rounds; each round
times ``--calls`` calls per variant; the report gives the median over rounds of the time per
call and the median over rounds of its ratio to ``attention`` in the same round, with
``os.getloadavg()`` printed next to every round.

Usage::

    python benchmarks/bench_serving_certificate.py [--context 32768 --heads 32 --kv-heads 8
        --head-dim 128 --keep 0.25] [--rounds 5 --calls 5] [--threads 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.protocol import load_average, median_ratio  # noqa: E402


def make_case(args: argparse.Namespace) -> dict:
    """Random cache, Poisson plan over the first ``context - 16`` positions, decode query."""
    g = torch.Generator().manual_seed(0)
    dev = torch.device(args.device)
    n_kv, T, d = args.kv_heads, args.context, args.head_dim
    H = args.heads
    G = H // n_kv
    P = T - 16  # the last tokens are generated ones (take-all)
    key = torch.randn(n_kv, T, d, generator=g)
    value = torch.randn(n_kv, T, d, generator=g)
    query = torch.randn(H, d, generator=g) * 1.5
    pi = torch.ones(n_kv, T, dtype=torch.float64)
    pi[:, 4:P - 64] = (torch.rand(n_kv, P - 68, generator=g, dtype=torch.float64)
                       * 2 * args.keep).clamp(1e-3, 1.0)
    kept = torch.rand(n_kv, T, generator=g, dtype=torch.float64) < pi
    bias = torch.where(kept, -torch.log(pi), torch.full_like(pi, float("-inf"))).float()
    tail = kept & (pi < 1)
    weight = torch.where(tail, 1 - pi, torch.zeros_like(pi)).float()
    m = int(tail.sum(1).max())
    tail_index = torch.zeros(n_kv, m, dtype=torch.long)
    tail_weight = torch.zeros(n_kv, m)
    for k in range(n_kv):
        idx = torch.nonzero(tail[k]).flatten()
        tail_index[k, :idx.numel()] = idx
        tail_weight[k, :idx.numel()] = weight[k, idx]
    W = torch.randn(4 * d, H * d, generator=g) / (H * d) ** 0.5
    cols = G * d
    gram = torch.stack([W[:, k * cols:(k + 1) * cols].T @ W[:, k * cols:(k + 1) * cols]
                        for k in range(n_kv)])
    case = dict(query=query, key=key, value=value, bias=bias, weight=weight,
                tail_index=tail_index, tail_weight=tail_weight, gram=gram,
                value_sq=(value * value).sum(-1))
    case = {k: v.to(dev) for k, v in case.items()}
    from tracesim.capture.inloop.onepass import pair_quadratic_forms

    case["quad"] = pair_quadratic_forms(case["value"], case["gram"], case["weight"])
    case["kept_fraction"] = float(kept.double().mean())
    return case


def attention(c: dict, scaling: float) -> torch.Tensor:
    n_kv, T, d = c["key"].shape
    H = c["query"].shape[0]
    q = c["query"].reshape(n_kv, H // n_kv, d)
    logits = torch.matmul(q, c["key"].transpose(1, 2)) * scaling + c["bias"][:, None, :]
    return torch.matmul(torch.softmax(logits, dim=-1), c["value"]).reshape(H, d)


def variants(c: dict, scaling: float, block: int) -> dict:
    from tracesim.capture.inloop.enforce import serving_certificates
    from tracesim.capture.inloop.onepass import onepass_attention

    def onepass(weight, gram=None):
        return lambda: onepass_attention(c["query"], c["key"], c["value"], c["bias"], weight,
                                         scaling, value_sq=c["value_sq"], gram=gram,
                                         quad=c["quad"] if gram is not None else None,
                                         block=block)

    def two_pass():
        attention(c, scaling)
        return serving_certificates(c["query"], c["key"], c["value"], c["bias"],
                                    c["tail_index"], c["tail_weight"], scaling)

    return {
        "attention": lambda: attention(c, scaling),
        "onepass, no certificate": onepass(None),
        "onepass + certificate": onepass(c["weight"]),
        "onepass + certificate + layer": onepass(c["weight"], c["gram"]),
        "two-pass (attention + serving_certificates)": two_pass,
    }


def run(args: argparse.Namespace) -> dict[str, float]:
    if args.threads:
        torch.set_num_threads(args.threads)
    c = make_case(args)
    scaling = args.head_dim ** -0.5
    fns = variants(c, scaling, args.block)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for fn in fns.values():  # warm-up
        fn()
    sync()
    per_round: dict[str, list[float]] = {name: [] for name in fns}
    print(f"context {args.context}, {args.heads}/{args.kv_heads} heads, d={args.head_dim}, "
          f"kept {c['kept_fraction']:.1%}, block {args.block}, device {args.device}, "
          f"torch threads {torch.get_num_threads()}")
    with torch.no_grad():
        for r in range(args.rounds):
            for name, fn in fns.items():
                sync()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                sync()
                per_round[name].append((time.perf_counter() - t0) / args.calls)
            load = load_average()
            print(f"round {r + 1}: " + ", ".join(
                f"{n.split(' (')[0]} {t[-1] * 1e3:.2f}" for n, t in per_round.items())
                + f" ms; load average {load}")
    medians = {name: statistics.median(t) for name, t in per_round.items()}
    # The ratio within each round pairs calls made seconds apart, so drifts in the machine's
    # speed cancel; its median over rounds is the headline.
    ratios = {name: median_ratio(t, per_round["attention"]) for name, t in per_round.items()}
    print(f"\n| variant | ms per call (median of {args.rounds}) | vs attention (median of the "
          f"per-round ratios) |")
    print("|---|---|---|")
    for name, t in medians.items():
        print(f"| {name} | {t * 1e3:.2f} | {ratios[name]:.2f}x |")
    print(f"load average at the end: {load_average()}")
    return medians


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--keep", type=float, default=0.25, help="mean inclusion probability")
    p.add_argument("--block", type=int, default=None,
                   help="keys per block of the one pass "
                   "(default: tracesim.capture.inloop.onepass.BLOCK)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if args.block is None:
        from tracesim.capture.inloop.onepass import BLOCK

        args.block = BLOCK
    np.set_printoptions(precision=3)
    return run(args)


if __name__ == "__main__":
    main()
