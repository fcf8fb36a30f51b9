"""The Python side of ``benchmarks/gpu_check.sh``: capture on CUDA, and decode-step costs.

``capture``: capture SmolLM2 on CUDA (bf16 compute, fp16 store), validate the store, then
recompute every stored attention output in float64 from the stored (fp16) queries, keys and
values, and report the relative error per (sequence, layer, head, query).

``steps``: a randomly initialized Llama-shaped model (32 layers, 32 query heads / 8 KV heads,
head_dim 128, hidden 4096) in bf16, one prompt of ``--context`` random tokens prefilled once,
then per-decode-step wall time of greedy decoding under: the full cache; top-k (an ``-inf``
bias); Poisson + ``-log pi`` offset; Poisson + offset + the one-pass certificate; Poisson +
offset + the two-pass certificate (reference). Configurations alternate for ``--rounds``
rounds; medians are reported.

``--dry`` runs both on the CPU with a tiny model and short contexts (seconds), so the code path
is tested without a GPU (``tests/test_gpu_check.py``). Dry-run figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- capture check


def recompute_errors(store_path: Path) -> dict[str, float]:
    """Relative error ``||o_stored - o_64|| / ||o_64||`` of every stored output, where ``o_64``
    is float64 causal attention of the stored query over the stored keys and values."""
    from tracesim.store import open_store

    store = open_store(store_path)
    m = store.model
    errors = []
    for seq in store:
        qpos = seq.query_positions
        kpos = np.arange(seq.n_positions)
        for layer in range(m.n_layers):
            for h in range(m.n_heads):
                g = m.kv_head(h)
                k = seq.keys(layer, g).astype(np.float64)
                v = seq.values(layer, g).astype(np.float64)
                s = seq.queries(layer, h).astype(np.float64) @ k.T * m.scaling
                s[kpos[None, :] > qpos[:, None]] = -np.inf
                w = np.exp(s - s.max(axis=1, keepdims=True))
                o = (w / w.sum(axis=1, keepdims=True)) @ v
                diff = np.linalg.norm(seq.outputs(layer, h).astype(np.float64) - o, axis=1)
                errors.append(diff / np.maximum(np.linalg.norm(o, axis=1), 1e-12))
    e = np.concatenate(errors)
    return {"n_outputs": int(e.size), "rel_err_median": float(np.median(e)),
            "rel_err_p99": float(np.quantile(e, 0.99)), "rel_err_max": float(e.max())}


def check_capture(args: argparse.Namespace) -> dict:
    from tracesim.capture.runner import CaptureConfig, run_capture

    from tracesim.store import validate_store

    out = Path(args.out) / "capture"
    if args.dry:
        from tracesim.capture.models import LoadedModel, load_tokenizer, tiny_model

        tok = load_tokenizer()
        model = LoadedModel(tiny_model("llama", seed=1, vocab_size=len(tok)), tok, "tiny-llama")
        kwargs = dict(device="cpu")
    else:
        model = "smollm2"
        kwargs = dict(device=args.device, compute_dtype="bfloat16")
    t0 = time.perf_counter()
    run_capture(model, ["passkey"], n=args.n, length=args.length, out=out,
                storage_dtype="float16", config=CaptureConfig(max_new_tokens=args.new_tokens),
                progress=False, **kwargs)
    seconds = time.perf_counter() - t0
    problems = validate_store(out)
    result = {"store": str(out), "capture_seconds": seconds, "valid": not problems,
              "problems": problems[:5], **recompute_errors(out)}
    # bf16 compute rounds each output to ~3 significant digits; a wrong mask or head mapping
    # gives errors of order 1.
    result["ok"] = bool(result["valid"] and result["rel_err_median"] < 2e-2
                        and result["rel_err_max"] < 0.25)
    return result


# --------------------------------------------------------------------------- decode steps


def llama_shaped(args: argparse.Namespace):
    import torch
    from tracesim.capture.attention import CAPTURE_ATTN, register
    from transformers import AutoConfig, AutoModelForCausalLM

    register()
    cfg = AutoConfig.for_model(
        "llama", vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=args.context + 1024,
        rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=None)
    dtype = torch.float32 if args.dry else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=CAPTURE_ATTN,
                                                 dtype=dtype)
    return model.eval()


def plans_for(n_layers: int, n_kv: int, P: int, budget: float, kind: str, seed: int = 0):
    """Per-layer plans over P prompt tokens: 4 sinks and 32 recent tokens always kept, the rest
    by random heavy-tailed scores: top-k, or Poisson capped-PPS at the same expected size."""
    import torch
    from tracesim.capture.inloop.enforce import LayerPlan

    from tracesim.designs import inclusion_probabilities

    rng = np.random.default_rng(seed)
    take = np.zeros(P, dtype=bool)
    take[:4] = True
    take[P - 32:] = True
    n_tail = max(1.0, budget * P - take.sum())
    plans = {}
    for layer in range(n_layers):
        pi = np.ones((n_kv, P))
        kept = np.ones((n_kv, P), dtype=bool)
        for g in range(n_kv):
            scores = np.exp(2.0 * rng.standard_normal((~take).sum()))
            if kind == "topk":
                keep = np.zeros(scores.size, dtype=bool)
                keep[np.argsort(-scores)[:int(n_tail)]] = True
                kept[g, ~take] = keep
            else:
                p = inclusion_probabilities(scores, n_tail)
                pi[g, ~take] = p
                kept[g, ~take] = rng.random(p.size) < p
        pi_t, kept_t = torch.from_numpy(pi), torch.from_numpy(kept)
        if kind == "topk":
            plans[layer] = LayerPlan(pi=pi_t, kept=kept_t, hajek=False, certified=False)
        else:
            plans[layer] = LayerPlan(pi=pi_t, kept=kept_t, hajek=True,
                                     certified=kind != "poisson")
    return plans


def decode_steps(args: argparse.Namespace) -> dict:
    import torch
    from tracesim.capture.attention import recording
    from tracesim.capture.generate import decode_greedy, prefill
    from tracesim.capture.inloop.enforce import EvictionState
    from tracesim.capture.inloop.evict import _restore

    model = llama_shaped(args)
    P = args.context
    ids = np.random.default_rng(0).integers(0, args.vocab, P).tolist()
    t0 = time.perf_counter()
    with torch.inference_mode():
        cache, logits = prefill(model, ids, prefill_chunk=args.prefill_chunk)
    _sync(args.device)
    prefill_s = time.perf_counter() - t0
    L, n_kv = args.layers, args.kv_heads
    configs = {
        "full cache": ({}, True),
        "top-k": (plans_for(L, n_kv, P, args.budget, "topk"), True),
        "poisson + offset": (plans_for(L, n_kv, P, args.budget, "poisson"), True),
        "poisson + offset + one-pass certificate":
            (plans_for(L, n_kv, P, args.budget, "certified"), True),
        "poisson + offset + two-pass certificate":
            (plans_for(L, n_kv, P, args.budget, "certified"), False),
    }

    def run(plans, one_pass) -> float:
        state = EvictionState(P, plans, {}, one_pass=one_pass)
        try:
            with torch.inference_mode(), recording(model, state):
                _sync(args.device)
                start = time.perf_counter()
                decode_greedy(model, cache, logits, P, args.steps + 1, state=state)
                _sync(args.device)
                return (time.perf_counter() - start) / args.steps
        finally:
            _restore(cache, P)

    for plans, one_pass in configs.values():  # warm-up
        run(plans, one_pass)
    times: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, (plans, one_pass) in configs.items():
            times[name].append(run(plans, one_pass))
        print(f"round {r + 1}: " + ", ".join(f"{n} {t[-1] * 1e3:.2f} ms" for n, t in times.items())
              + f"; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    base = med["top-k"]
    return {"context": P, "layers": L, "heads": args.heads, "kv_heads": n_kv,
            "head_dim": args.head_dim, "budget": args.budget, "steps": args.steps,
            "rounds": args.rounds, "prefill_seconds": prefill_s,
            "ms_per_step": {n: t * 1e3 for n, t in med.items()},
            "vs_topk": {n: t / base for n, t in med.items()},
            "load_average": list(os.getloadavg())}


# --------------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="GPU check (see benchmarks/gpu_check.sh)")
    p.add_argument("what", choices=("capture", "steps"))
    p.add_argument("--dry", action="store_true", help="tiny CPU run of the same code path")
    p.add_argument("--out", default="results/gpu_check")
    p.add_argument("--device", default="cuda")
    # capture
    p.add_argument("--n", type=int, default=2, help="capture: sequences")
    p.add_argument("--length", type=int, default=4096, help="capture: prompt length")
    p.add_argument("--new-tokens", type=int, default=16, help="capture: decode steps")
    # steps
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefill-chunk", type=int, default=2048)
    args = p.parse_args(argv)
    if args.dry:
        args.device = "cpu"
        args.n, args.length, args.new_tokens = 1, 160, 4
        args.context, args.layers, args.heads, args.kv_heads = 256, 2, 4, 2
        args.head_dim, args.hidden, args.intermediate, args.vocab = 16, 64, 128, 256
        args.steps, args.rounds, args.prefill_chunk = 2, 2, 128
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.dry:
        import torch

        if args.device.startswith("cuda") and not torch.cuda.is_available():
            print("gpu_check: no CUDA device (use --dry for the CPU dry run)", file=sys.stderr)
            return 3
    result = check_capture(args) if args.what == "capture" else decode_steps(args)
    result["dry"] = bool(args.dry)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.what}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
