"""Serving cost of randomized eviction: Poisson sampling + -log(pi) offset + certificates.

Two measurements, each side by side in one run (interleaved repeats, best of ``--repeats``):

1. **End to end** on the default model: one prompt is prefilled once, then ``--steps`` greedy
   decode steps are timed under (a) the full cache, (b) deterministic top-k at the budget
   (an additive ``-inf`` bias), (c) Poisson capped-PPS with the Hájek offset, no certificate
   (the same bias cost as top-k plus the sampling), (d) (c) plus the per-head certificate, and
   (e) (d) plus the per-layer output-space (GQA) certificate. Kept-set planning (scores, PPS,
   permanent random numbers) happens once per configuration and is timed separately.
2. **One attention call** at a realistic serving size (``--heads`` query heads sharing
   ``--kv-heads`` KV heads over ``--context`` cached tokens, one decode query): SDPA with a
   top-k ``-inf`` mask vs SDPA with the Hájek bias plus the certificate pass.

Usage::

    python benchmarks/bench_evict.py [--length 1024] [--steps 16] [--budget 0.25]
        [--context 32768 --heads 32 --kv-heads 8] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def end_to_end(args: argparse.Namespace) -> list[tuple[str, float]]:
    from tracesim.capture.inloop.evict import (
        LayerPlan,
        decode_policy,
        layer_plans,
        prefill_sequence,
    )
    from tracesim.capture.models import load_model
    from tracesim.capture.tasks import build_prompt

    from tracesim.policies import make_policy

    loaded = load_model(args.model, args.device)
    prompt = build_prompt(loaded.tokenizer, "passkey", args.length, 0, 0.5)
    scaling = float(loaded.model.config.head_dim ** -0.5
                    if getattr(loaded.model.config, "head_dim", None)
                    else (loaded.model.config.hidden_size
                          // loaded.model.config.num_attention_heads) ** -0.5)
    pre = prefill_sequence(loaded.model, prompt.token_ids, question_start=prompt.question_start,
                           scaling=scaling, layer_certificate=True)
    grams = pre.grams
    topk = make_policy("snapkv", "topk", args.budget)
    poisson = make_policy("snapkv", "poisson", args.budget)
    t_plan_topk = _best(lambda: layer_plans(pre.traces, topk, 0), 2)
    t_plan_poisson = _best(lambda: layer_plans(pre.traces, poisson, 0), 2)
    plans_topk = layer_plans(pre.traces, topk, 0)
    plans_poisson = layer_plans(pre.traces, poisson, 0)
    uncertified = {k: LayerPlan(v.pi, v.kept, v.hajek, False) for k, v in plans_poisson.items()}
    cases = {
        "full cache": ({}, None),
        "top-k (-inf bias)": (plans_topk, None),
        "poisson + hajek offset": (uncertified, None),
        "+ head certificates": (plans_poisson, {}),
        "+ layer (GQA) certificate": (plans_poisson, grams),
    }
    steps = args.steps + 1  # the first token comes from the prefill logits
    times = {name: float("inf") for name in cases}
    for _ in range(args.repeats):
        for name, (plans, g) in cases.items():
            pre.grams = grams if g is None else g
            t0 = time.perf_counter()
            decode_policy(loaded.model, pre, plans, steps, set())
            times[name] = min(times[name], (time.perf_counter() - t0) / args.steps)
    rows = [(name, t) for name, t in times.items()]
    rows.append(("plan top-k kept sets (once)", t_plan_topk))
    rows.append(("plan poisson kept sets (once)", t_plan_poisson))
    return rows


def one_call(args: argparse.Namespace) -> list[tuple[str, float]]:
    from tracesim.capture.inloop.enforce import serving_certificates

    from tracesim.designs import inclusion_probabilities

    dev = torch.device(args.device)
    H, Hk, T, d = args.heads, args.kv_heads, args.context, 128
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(H, d, generator=gen).to(dev)
    k = torch.randn(Hk, T, d, generator=gen).to(dev)
    v = torch.randn(Hk, T, d, generator=gen).to(dev)
    scores = torch.rand(Hk, T, generator=gen).double()
    n = int(args.budget * T)
    pi = torch.stack([torch.from_numpy(inclusion_probabilities(scores[g].numpy(), n,
                                                               mixture=0.2)) for g in range(Hk)])
    u = torch.rand(Hk, T, generator=gen, dtype=torch.float64)
    kept = u < pi
    top = torch.zeros(Hk, T, dtype=torch.bool)
    top.scatter_(1, torch.topk(scores, n, dim=1).indices, True)
    bias_topk = torch.where(top, 0.0, float("-inf")).float().to(dev)
    bias_hajek = torch.where(kept, -torch.log(pi), float("-inf")).float().to(dev)
    from tracesim.capture.inloop.enforce import LayerPlan

    plan = LayerPlan(pi, kept, hajek=True, certified=True)
    tail_index, tail = plan.tail_index.to(dev), plan.tail_weight.to(dev)
    G = H // Hk
    scale = d ** -0.5

    # GQA expansion and masks are prepared outside the timed calls (a serving kernel reads the
    # shared KV head directly), so SDPA is timed at its best.
    k_rep, v_rep = k.repeat_interleave(G, 0)[None], v.repeat_interleave(G, 0)[None]
    masks = {id(b): b.repeat_interleave(G, 0)[None, :, None, :] for b in (bias_topk, bias_hajek)}

    def sdpa(bias):
        return torch.nn.functional.scaled_dot_product_attention(
            q[None, :, None, :], k_rep, v_rep, attn_mask=masks[id(bias)], scale=scale)

    def attention_only(bias):
        # The same einsum/softmax path as serving_certificates, without the certificate.
        qg = q.reshape(Hk, G, d)
        a = torch.softmax(torch.einsum("kgd,ktd->kgt", qg, k) * scale + bias[:, None, :], -1)
        return torch.einsum("kgt,ktd->kgd", a, v)

    def sync(fn):
        def run():
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        return run

    sdpa(bias_topk)
    serving_certificates(q, k, v, bias_hajek, tail_index, tail, scale)
    t_topk = _best(sync(lambda: sdpa(bias_topk)), args.repeats * 3)
    t_hajek = _best(sync(lambda: sdpa(bias_hajek)), args.repeats * 3)
    t_attn = _best(sync(lambda: attention_only(bias_hajek)), args.repeats * 3)
    t_cert = _best(sync(lambda: serving_certificates(q, k, v, bias_hajek, tail_index, tail,
                                                     scale)), args.repeats * 3)
    return [(f"SDPA top-k mask ({H}x{T})", t_topk), ("SDPA hajek bias", t_hajek),
            ("einsum attention, hajek bias", t_attn),
            ("einsum attention + certificate (torch)", t_cert)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--skip-model", action="store_true")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    print(f"device {args.device}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    if not args.skip_model:
        rows = end_to_end(args)
        base = rows[1][1]
        print(f"\nEnd to end, {args.model}, {args.length}-token prompt, budget {args.budget}, "
              f"{args.steps} decode steps (ms per step; ratio vs top-k):")
        for name, t in rows:
            print(f"  {name:<32} {1e3 * t:9.2f} ms   {t / base:6.2f}x")
    rows = one_call(args)
    base = rows[0][1]
    print(f"\nOne decode attention call, {args.heads} heads / {args.kv_heads} KV heads, "
          f"{args.context} tokens, head_dim 128 (ms; ratio vs top-k):")
    for name, t in rows:
        print(f"  {name:<40} {1e3 * t:9.2f} ms   {t / base:6.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
