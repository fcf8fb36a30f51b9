"""A store against an independent eager forward of its model, and against its recorded rule.

For each sequence of a store captured from a whole model, the model is run once more with
transformers' own ``eager`` attention over the stored token ids (one forward, no cache, the
model's own masks), the input of every layer's ``o_proj`` is caught, and the stored outputs are
compared with it at the stored query positions. The float64 rule of ``model.json``
(``tracesim.attention_rule.attention_outputs`` with the recorded windows, soft-cap and sinks)
is checked on the stored Q/K/V as well. Usage::

    python -m tracesim.capture.verify STORE --model gemma3-270m [--layers 0,5]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
import torch
from tracesim.capture.attention import attention_modules
from tracesim.capture.models import load_model

from tracesim.attention_rule import attention_outputs, layer_window


def eager_outputs(model: Any, token_ids: list[int]) -> list[np.ndarray]:
    """Per layer ``(H, n_positions, D)`` o_proj inputs of one eager forward over ``token_ids``."""
    mods = attention_modules(model)
    caught: dict[int, torch.Tensor] = {}
    hooks = [m.o_proj.register_forward_hook(
        lambda mod, inp, out, i=i: caught.__setitem__(i, inp[0][0].detach()))
        for i, m in enumerate(mods)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([token_ids], device=model.device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    n_heads, head_dim = model.config.num_attention_heads, mods[0].head_dim
    return [caught[i].float().cpu().reshape(len(token_ids), n_heads, head_dim)
            .transpose(0, 1).numpy() for i in range(len(mods))]


def verify_store(store_path: str, model_name: str, layers: list[int] | None = None
                 ) -> list[dict[str, Any]]:
    """Per (sequence, layer): the largest |stored - eager| and |stored - float64 rule|, and the
    largest |eager| (the scale), over every stored query position and head."""
    from tracesim.store import open_store

    store = open_store(store_path)
    if store.is_subset:
        raise ValueError(f"{store_path}: verify needs a store of the whole model")
    loaded = load_model(model_name, attn_implementation="eager")
    m = store.model
    rows = []
    for seq in store:
        ids = [int(t) for t in seq.token_ids]
        eager = eager_outputs(loaded.model, ids)
        pos = seq.query_positions
        for layer in layers if layers is not None else range(m.n_layers):
            stored = np.stack([seq.outputs(layer, h) for h in range(m.n_heads)])
            ref = eager[layer][:, pos]
            q = np.stack([seq.queries(layer, h) for h in range(m.n_heads)])
            k = np.stack([seq.keys(layer, g) for g in range(m.n_kv_heads)])
            v = np.stack([seq.values(layer, g) for g in range(m.n_kv_heads)])
            sinks = None if m.sinks is None else np.asarray(m.sinks[layer])
            rule = attention_outputs(q, k, v, pos, m.scaling,
                                     window=layer_window(m.layer_attention, layer),
                                     softcap=m.attn_logit_softcap, sinks=sinks)
            rows.append(dict(sequence=seq.sequence_id, layer=layer,
                             window=layer_window(m.layer_attention, layer),
                             eager_err=float(np.abs(stored - ref).max()),
                             rule_err=float(np.abs(stored - rule).max()),
                             scale=float(np.abs(ref).max())))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tracesim.capture.verify", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--layers", default=None, help="comma-separated stored layers (default all)")
    args = ap.parse_args(argv)
    layers = None if args.layers is None else [int(x) for x in args.layers.split(",")]
    try:
        rows = verify_store(args.store, args.model, layers)
    except (ValueError, FileNotFoundError) as exc:
        print(f"verify: {exc}")
        return 2
    print(f"{'sequence':<24} {'layer':>5} {'window':>6} {'|o-eager|':>10} {'|o-rule|':>10} "
          f"{'max|o|':>8}")
    for r in rows:
        print(f"{r['sequence'][:24]:<24} {r['layer']:>5} {str(r['window']):>6} "
              f"{r['eager_err']:>10.2e} {r['rule_err']:>10.2e} {r['scale']:>8.3g}")
    worst = max(r["eager_err"] / max(1.0, r["scale"]) for r in rows)
    print(f"largest |stored - eager| / max(1, max|o|): {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
