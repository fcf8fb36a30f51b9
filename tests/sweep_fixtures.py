"""Tiny synthetic trace stores for the sweep tests (random Q/K/V, exact full-cache outputs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tracesim.store import ModelMeta, TraceWriter


def _layer(rng: np.random.Generator, H: int, n_kv: int, d: int, P: int, prompt: int,
           qpos: np.ndarray) -> dict[str, np.ndarray]:
    """One layer: float32 K/V (n_kv, P, d), Q/O at ``qpos`` (H, n_q, d), h2o sums (H, P)."""
    G = H // n_kv
    keys = rng.standard_normal((n_kv, P, d)).astype(np.float32)
    keys[:, rng.choice(P, size=P // 12, replace=False)] *= 2.5
    values = rng.standard_normal((n_kv, P, d)).astype(np.float32)
    q_all = (rng.standard_normal((H, P, d)) * 1.5).astype(np.float32)
    causal = np.arange(P)[None, :] > np.arange(P)[:, None]
    outputs = np.empty((H, qpos.size, d))
    h2o = np.empty((H, P), np.float32)
    for h in range(H):
        s = q_all[h].astype(np.float64) @ keys[h // G].T.astype(np.float64) * d**-0.5
        s[causal] = -np.inf
        w = np.exp(s - s.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        h2o[h] = w[:prompt].sum(axis=0)
        outputs[h] = (w @ values[h // G].astype(np.float64))[qpos]
    return dict(keys=keys, values=values, queries=q_all[:, qpos],
                outputs=outputs.astype(np.float32), h2o=h2o)


def build_sweep_store(path: Path, *, n_seqs: int = 3, n_layers: int = 3, H: int = 4,
                      n_kv: int = 2, d: int = 8, P: int = 72, prompt: int = 60,
                      seed: int = 0, tasks: tuple[str, ...] = ("alpha", "beta")) -> Path:
    """A valid float32 store: sequence ``s{i}`` has ``P + 4 i`` positions, task cycling."""
    model = ModelMeta(model_id="synthetic-sweep", architecture="LlamaForCausalLM",
                      n_layers=n_layers, n_heads=H, n_kv_heads=n_kv, head_dim=d,
                      hidden_size=16, scaling=d**-0.5, dtype="float32")
    rng = np.random.default_rng(seed)
    W = (rng.standard_normal((n_layers, 16, H * d)) / np.sqrt(d)).astype(np.float32)
    with TraceWriter(path, model, o_proj=W) as writer:
        for i in range(n_seqs):
            P_i, pl = P + 4 * i, prompt + 4 * i
            qs = pl - 10
            qpos = np.array(list(range(qs - 6, qs)) + list(range(pl - 6, pl))
                            + list(range(pl, P_i)), dtype=np.int64)
            roles = ["context_window"] * 6 + ["question_window"] * 6 + ["decode"] * (P_i - pl)
            n_gen = P_i - pl + 1
            row = dict(task=tasks[i % len(tasks)], seed=i, length=P_i,
                       token_ids=rng.integers(0, 500, P_i, dtype=np.int32), prompt_length=pl,
                       context_start=0, context_end=qs, question_start=qs, question_end=pl,
                       generated_ids=[1] * n_gen,
                       generated_logprobs=np.full(n_gen, -0.5, np.float32), answer="7",
                       gold="7", correct=i % 2 == 0, query_positions=qpos.tolist(),
                       query_roles=roles)
            with writer.sequence(f"s{i}", **row) as sw:
                for layer in range(n_layers):
                    sw.add_layer(layer, **_layer(rng, H, n_kv, d, P_i, pl, qpos))
    return Path(path)


SPEC_TEXT = """\
name: tiny
store: store
layers: all
grid:
  score: [snapkv, h2o, streaming, random, full]
  design: [topk, poisson]
  budget: [0.3, 0.6, 24]
  allocator: [uniform, adakv]
  score_params:
    "*": {window: 6}
seeds: 3
output: out
"""

#: A two-score, two-design, two-budget, two-seed sweep over a ``store`` beside the spec: the
#: small results dataset the results readers' tests (DuckDB, Dask) are run on.
MINI_SPEC = """\
name: mini
store: store
layers: all
grid:
  score: [snapkv, random]
  design: [topk, poisson]
  budget: [0.3, 0.6]
  score_params:
    "*": {window: 6}
seeds: 2
output: out
"""
