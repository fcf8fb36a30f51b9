"""Synthetic trace stores for the replay tests: random Q/K/V with exact full-cache outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tracesim.policies import LayerTrace
from tracesim.store import ModelMeta, TraceWriter


def synthetic_layer_arrays(rng: np.random.Generator, *, n_heads: int, n_kv: int, d: int,
                           P: int, prompt_length: int, qpos: np.ndarray, dtype: str):
    """One layer: keys/values (n_kv, P, d), queries/outputs (H, n_q, d), h2o (H, P)."""
    G = n_heads // n_kv
    keys = rng.standard_normal((n_kv, P, d))
    # A few heavy tokens, so attention is not flat and policies disagree.
    keys[:, rng.choice(P, size=max(1, P // 16), replace=False)] *= 2.5
    values = rng.standard_normal((n_kv, P, d))
    q_all = rng.standard_normal((n_heads, P, d)) * 1.6
    cast = np.dtype(dtype)
    keys, values, q_all = (a.astype(cast).astype(np.float64) for a in (keys, values, q_all))
    scale = d**-0.5
    h2o = np.zeros((n_heads, P), np.float32)
    outputs = np.empty((n_heads, qpos.size, d))
    causal = np.arange(P)[None, :] > np.arange(P)[:, None]
    for h in range(n_heads):
        s = q_all[h] @ keys[h // G].T * scale
        s[causal] = -np.inf
        w = np.exp(s - s.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        h2o[h] = w[:prompt_length].sum(axis=0).astype(np.float32)
        outputs[h] = (w @ values[h // G])[qpos]
    return dict(keys=keys.astype(cast), values=values.astype(cast),
                queries=q_all[:, qpos].astype(cast), outputs=outputs.astype(cast), h2o=h2o)


def sequence_layout(P: int, prompt_length: int, w: int = 8, question_len: int = 12):
    """Query positions/roles: context window, question window and decode steps."""
    qs = prompt_length - question_len
    ctx = list(range(qs - w, qs))
    qwin = list(range(prompt_length - w, prompt_length))
    dec = list(range(prompt_length, P))
    positions = np.array(ctx + qwin + dec, dtype=np.int64)
    roles = ["context_window"] * w + ["question_window"] * w + ["decode"] * len(dec)
    return positions, roles, qs


def build_store(path: Path, *, n_seqs: int = 2, n_layers: int = 2, n_heads: int = 4,
                n_kv: int = 2, d: int = 8, P: int = 96, prompt_length: int = 80,
                dtype: str = "float32", o_proj: bool = True, seed: int = 0,
                hidden: int = 16) -> Path:
    """Write a small valid store with ``n_seqs`` sequences and return its path."""
    model = ModelMeta(model_id="synthetic", architecture="LlamaForCausalLM", n_layers=n_layers,
                      n_heads=n_heads, n_kv_heads=n_kv, head_dim=d, hidden_size=hidden,
                      scaling=d**-0.5, dtype=dtype)
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((n_layers, hidden, n_heads * d)).astype(np.float32) / np.sqrt(d)
    with TraceWriter(path, model, o_proj=W if o_proj else None) as writer:
        for s in range(n_seqs):
            P_s = P + 8 * s
            pl = prompt_length + 8 * s
            qpos, roles, qs = sequence_layout(P_s, pl)
            n_gen = P_s - pl + 1
            row = dict(task="synthetic", seed=s, length=P_s,
                       token_ids=rng.integers(0, 1000, P_s, dtype=np.int32), prompt_length=pl,
                       context_start=0, context_end=qs, question_start=qs, question_end=pl,
                       generated_ids=rng.integers(0, 1000, n_gen).tolist(),
                       generated_logprobs=(-rng.random(n_gen)).astype(np.float32),
                       answer="1", gold="1", correct=bool(s % 2 == 0),
                       query_positions=qpos.tolist(), query_roles=roles)
            with writer.sequence(f"seq{s}", **row) as sw:
                for layer in range(n_layers):
                    sw.add_layer(layer, **synthetic_layer_arrays(
                        rng, n_heads=n_heads, n_kv=n_kv, d=d, P=P_s, prompt_length=pl,
                        qpos=qpos, dtype=dtype))
    return Path(path)


def synthetic_trace(seed: int = 0, *, n_heads: int = 4, n_kv: int = 2, d: int = 8, P: int = 96,
                    prompt_length: int = 80, o_proj: bool = True, decode: bool = True,
                    hidden: int = 16) -> LayerTrace:
    """An in-memory LayerTrace (float64) with the same layout as :func:`build_store`."""
    rng = np.random.default_rng(seed)
    qpos, roles, qs = sequence_layout(P, prompt_length)
    if not decode:
        keep = np.array([r != "decode" for r in roles])
        qpos, roles = qpos[keep], [r for r in roles if r != "decode"]
    arrays = synthetic_layer_arrays(rng, n_heads=n_heads, n_kv=n_kv, d=d, P=P,
                                    prompt_length=prompt_length, qpos=qpos, dtype="float64")
    W = rng.standard_normal((hidden, n_heads * d)) / np.sqrt(d) if o_proj else None
    return LayerTrace(layer=0, keys=arrays["keys"], values=arrays["values"],
                      queries=arrays["queries"], outputs=arrays["outputs"],
                      h2o=arrays["h2o"].astype(np.float64), query_positions=qpos,
                      query_roles=roles, prompt_length=prompt_length, question_start=qs,
                      scale=d**-0.5, o_proj=W, sequence_id=f"syn{seed}",
                      meta={"task": "synthetic", "correct": True})


def assert_same_on_one_and_two_threads(trace: LayerTrace, policies: list, seeds: np.ndarray,
                                       **options) -> tuple:
    """Replay on 1 and on 2 numba threads and assert the two results are the same bytes
    (``out`` and ``lout``); returns both. ``options`` go to :func:`replay_layer`."""
    import numba

    from tracesim.replay import replay_layer

    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = replay_layer(trace, policies, seeds, n_layers=2, **options)
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two = replay_layer(trace, policies, seeds, n_layers=2, **options)
    finally:
        numba.set_num_threads(before)
    assert one.out.tobytes() == two.out.tobytes()
    assert one.lout.tobytes() == two.lout.tobytes()
    return one, two
