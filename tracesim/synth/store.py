"""Writing a synthetic trace store: :class:`SynthConfig` and :func:`write_synthetic_store`."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tracesim.atomic import atomic_write_bytes
from tracesim.store import ModelMeta, StoreError, TraceWriter
from tracesim.store.format import MODEL_FILE, storage_dtype

from .attention import BLOCK, causal_attention, weighted_attention_sums
from .model import (
    _H2O,
    _OPROJ,
    _ROW,
    CHUNK,
    LOCAL_WINDOW,
    key_chunk,
    layer_model,
    queries,
    rng_for,
)

__all__ = ["SHAPES", "SynthConfig", "write_synthetic_store"]

#: Model shapes: (model_id, n_layers, n_heads, n_kv_heads, head_dim, hidden_size).
SHAPES: dict[str, tuple[str, int, int, int, int, int]] = {
    "smollm2": ("synthetic-smollm2", 30, 9, 3, 64, 576),
    "llama": ("synthetic-llama", 32, 32, 8, 128, 4096),
}
_VOCAB = 49152
_QUERY_STREAM, _H2O_STREAM = 0, 1
_SINKS = 6  # rng_for purpose of the sink logits (after model.py's six)


@dataclass(frozen=True)
class SynthConfig:
    """What :func:`write_synthetic_store` writes.

    Attributes
    ----------
    positions : int
        Stored positions per sequence (prompt plus decode steps), ``>= 2 * window + decode + 8``.
    shape : {"smollm2", "llama"}
        Model shape (:data:`SHAPES`).
    layers : int, optional
        Number of layers (default: the shape's).
    sequences : int
        Number of sequences.
    decode : int
        Decode steps recorded as queries (the last ``decode`` positions).
    window : int
        Observation windows (``context_window`` and ``question_window`` queries) in tokens.
    question : int
        Question length in tokens (``question_start = prompt_length - question``).
    h2o_queries : int
        Prefill queries the H2O statistic is accumulated from: one per stratum of the prompt,
        weighted by the stratum size (exact when ``>= prompt_length``).
    dtype : {"float16", "float32"}
        Storage dtype.
    o_proj : bool
        Store random ``o_proj`` weights (needed by the output-space certificate).
    seed : int
    sliding_window : int, optional
        Make layers sliding-window layers of this window (the query at ``t`` attends
        ``(t - w, t]``); every ``full_every``-th layer (the last of each run) stays full, as in
        Gemma 3 (5 sliding : 1 full). Recorded in ``model.json`` ``layer_attention``.
    full_every : int
        See ``sliding_window`` (default 6).
    softcap : float, optional
        Attention-logit soft-cap of every layer (``model.json`` ``attn_logit_softcap``).
    sinks : bool
        Give every (layer, query head) a learned sink logit (``model.json`` ``sinks``), drawn
        from the seed.
    """

    positions: int
    shape: str = "smollm2"
    layers: int | None = None
    sequences: int = 1
    decode: int = 64
    window: int = 32
    question: int = 32
    h2o_queries: int = 256
    dtype: str = "float16"
    o_proj: bool = True
    seed: int = 0
    sliding_window: int | None = None
    full_every: int = 6
    softcap: float | None = None
    sinks: bool = False

    def __post_init__(self) -> None:
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or not
                                                isinstance(self.sliding_window, int)
                                                or self.sliding_window < 1):
            raise ValueError(f"sliding_window = {self.sliding_window!r}: expected an int >= 1")
        if isinstance(self.full_every, bool) or not isinstance(self.full_every, int) or \
                self.full_every < 1:
            raise ValueError(f"full_every = {self.full_every!r}: expected an int >= 1")
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
            raise ValueError(f"softcap = {self.softcap!r}: expected a finite float > 0")
        if self.shape not in SHAPES:
            raise ValueError(f"shape = {self.shape!r}: expected one of {sorted(SHAPES)}")
        for name in ("sequences", "decode", "window", "question", "h2o_queries"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r}: expected a positive int")
        if self.layers is not None and (not isinstance(self.layers, int) or self.layers < 1):
            raise ValueError(f"layers = {self.layers!r}: expected a positive int")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed = {self.seed!r}: expected an int >= 0")
        if self.dtype not in ("float16", "float32"):
            raise ValueError(f"dtype = {self.dtype!r}: expected 'float16' or 'float32'")
        low = self.decode + self.question + self.window + 8
        if not isinstance(self.positions, int) or self.positions < low:
            raise ValueError(f"positions = {self.positions!r}: expected an int >= {low} "
                             "(decode + question + window + 8)")

    @property
    def n_layers(self) -> int:
        return self.layers if self.layers is not None else SHAPES[self.shape][1]

    @property
    def prompt_length(self) -> int:
        return self.positions - self.decode

    @property
    def question_start(self) -> int:
        return self.prompt_length - self.question

    def model(self) -> ModelMeta:
        model_id, _, n_heads, n_kv, d, hidden = SHAPES[self.shape]
        return ModelMeta(model_id=model_id, architecture="LlamaForCausalLM",
                         n_layers=self.n_layers, n_heads=n_heads, n_kv_heads=n_kv, head_dim=d,
                         hidden_size=hidden, scaling=d**-0.5, dtype=self.dtype)

    def layer_window(self, layer: int) -> int | None:
        """The window of ``layer``, or ``None`` for a full layer."""
        if self.sliding_window is None or (layer + 1) % self.full_every == 0:
            return None
        return self.sliding_window

    def sink_logits(self) -> np.ndarray | None:
        """``(n_layers, n_heads)`` sink logits drawn from the seed, or ``None``."""
        if not self.sinks:
            return None
        rng = rng_for(self.seed, _SINKS, 0)
        return rng.normal(0.0, 1.0, (self.n_layers, self.model().n_heads))

    def attention_fields(self) -> dict:
        """The optional ``model.json`` fields of the attention variants asked for."""
        out: dict = {}
        if self.sliding_window is not None:
            out["layer_attention"] = [
                {"kind": "full", "window": None} if self.layer_window(i) is None
                else {"kind": "sliding", "window": self.layer_window(i)}
                for i in range(self.n_layers)]
        if self.softcap is not None:
            out["attn_logit_softcap"] = float(self.softcap)
        sinks = self.sink_logits()
        if sinks is not None:
            out["sinks"] = sinks.tolist()
        return out

    def query_layout(self) -> tuple[np.ndarray, list[str]]:
        """Recorded query positions (sorted) and roles, as the capture runner lays them out."""
        P, pl, qs, w = self.positions, self.prompt_length, self.question_start, self.window
        roles: dict[int, str] = {}
        for role, span in (("context_window", range(max(0, qs - w), qs)),
                           ("question_window", range(max(0, pl - w), pl)),
                           ("decode", range(pl, P))):
            for p in span:
                roles.setdefault(p, role)
        ordered = sorted(roles)
        return np.array(ordered, dtype=np.int64), [roles[p] for p in ordered]


def _h2o_sample(cfg: SynthConfig, sequence: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Stratified sample of prefill query positions and their weights (stratum sizes)."""
    pl = cfg.prompt_length
    n = min(cfg.h2o_queries, pl)
    edges = np.round(np.linspace(0, pl, n + 1)).astype(np.int64)
    if n == pl:
        return np.arange(pl, dtype=np.int64), np.ones(pl)
    rng = rng_for(cfg.seed, _H2O, sequence, layer)
    pos = edges[:-1] + (rng.random(n) * np.diff(edges)).astype(np.int64)
    return pos, np.diff(edges).astype(np.float64)


def _layer(cfg: SynthConfig, sequence: int, layer: int) -> dict[str, np.ndarray]:
    """Every stored array of one layer of one sequence (storage dtype; h2o float32)."""
    meta = cfg.model()
    H, n_kv, d = meta.n_heads, meta.n_kv_heads, meta.head_dim
    G = H // n_kv
    P, pl = cfg.positions, cfg.prompt_length
    dt = storage_dtype(cfg.dtype)
    lm = layer_model(cfg.seed, layer, H, n_kv, d)
    qpos, _ = cfg.query_layout()
    hpos, hweight = _h2o_sample(cfg, sequence, layer)
    keys = np.empty((n_kv, P, d), dtype=dt)
    values = np.empty((n_kv, P, d), dtype=dt)
    stored_q = np.empty((H, qpos.size, d), dtype=dt)
    outputs = np.empty((H, qpos.size, d), dtype=dt)
    h2o = np.empty((H, P), dtype=np.float32)
    far = max(cfg.question_start - 4 * LOCAL_WINDOW, 0)
    window, sinks = cfg.layer_window(layer), cfg.sink_logits()
    for g in range(n_kv):
        for a in range(0, P, CHUNK):
            k, v = key_chunk(lm, cfg.seed, sequence, layer, g, a, min(P, a + CHUNK))
            keys[g, a:a + k.shape[0]] = k
            values[g, a:a + k.shape[0]] = v
        heads = range(g * G, (g + 1) * G)
        # Queries are rounded to the storage dtype first, so the stored outputs are the exact
        # attention of the stored queries over the stored keys and values.
        q_rows = []
        for h in heads:
            q = queries(lm, cfg.seed, sequence, layer, h, qpos, stream=_QUERY_STREAM,
                        decode_from=pl, keys=keys[g], far_limit=far)
            stored_q[h] = q.astype(dt)
            q_rows.append(stored_q[h].astype(np.float64))
        variant = dict(window=window, softcap=cfg.softcap)
        out, _, _ = causal_attention(
            np.concatenate(q_rows), np.tile(qpos, G), keys[g], values[g], meta.scaling,
            sinks=None if sinks is None else np.repeat(sinks[layer, g * G:(g + 1) * G],
                                                       qpos.size), **variant)
        outputs[g * G:(g + 1) * G] = out.reshape(G, qpos.size, d).astype(dt)
        hq = np.concatenate([
            queries(lm, cfg.seed, sequence, layer, h, hpos, stream=_H2O_STREAM).astype(dt)
            .astype(np.float64) for h in heads])
        hq_pos = np.tile(hpos, G)
        _, m, lsum = causal_attention(
            hq, hq_pos, keys[g], values[g], meta.scaling,
            sinks=None if sinks is None else np.repeat(sinks[layer, g * G:(g + 1) * G],
                                                       hpos.size), **variant)
        h2o[g * G:(g + 1) * G] = weighted_attention_sums(
            hq, hq_pos, hweight, keys[g], meta.scaling, m, lsum, G,
            **variant).astype(np.float32)
    return dict(keys=keys, values=values, queries=stored_q, outputs=outputs, h2o=h2o)


def synth_sizes(cfg: SynthConfig) -> tuple[float, float]:
    """(peak memory, bytes written) of :func:`write_synthetic_store`, estimated from the
    configuration alone (nothing is allocated): the o_proj weights are held whole, one layer
    of one sequence at a time, with the float64 working arrays of the blocked attention."""
    m = cfg.model()
    H, n_kv, d, P = m.n_heads, m.n_kv_heads, m.head_dim, cfg.positions
    G = H // n_kv
    nq = cfg.decode + 2 * cfg.window + 8  # recorded queries (an upper bound of the layout)
    hq = min(cfg.h2o_queries, P)
    item = 2 if cfg.dtype == "float16" else 4
    o_proj = 4.0 * m.n_layers * m.hidden_size * H * d if cfg.o_proj else 0.0
    layer = (item * (2 * n_kv * P * d + 2 * H * nq * d) + 4.0 * H * P)
    working = 8.0 * (G * (nq + hq) * (d + BLOCK + 4) + 2 * P * d + G * P)
    row = 4.0 * P + 16.0 * P  # token ids, plus the position arrays of the layout
    memory = o_proj + layer + working + row
    written = o_proj + cfg.sequences * (m.n_layers * layer + row)
    return memory, written


def _o_proj(cfg: SynthConfig) -> np.ndarray | None:
    if not cfg.o_proj:
        return None
    m = cfg.model()
    cols = m.n_heads * m.head_dim
    out = np.empty((m.n_layers, m.hidden_size, cols), dtype=np.float32)
    for layer in range(m.n_layers):
        rng = rng_for(cfg.seed, _OPROJ, layer)
        out[layer] = rng.standard_normal((m.hidden_size, cols), dtype=np.float32)
        out[layer] *= np.float32(cols**-0.5)
    return out


def _row(cfg: SynthConfig, sequence: int) -> dict:
    rng = rng_for(cfg.seed, _ROW, sequence)
    qpos, roles = cfg.query_layout()
    n_gen = cfg.decode + 1
    return dict(
        task="synthetic", seed=cfg.seed, length=cfg.positions,
        token_ids=rng.integers(0, _VOCAB, cfg.positions, dtype=np.int32),
        prompt_length=cfg.prompt_length, context_start=0, context_end=cfg.question_start,
        question_start=cfg.question_start, question_end=cfg.prompt_length,
        generated_ids=rng.integers(0, _VOCAB, n_gen, dtype=np.int32),
        generated_logprobs=-rng.exponential(0.5, n_gen).astype(np.float32),
        answer="", gold="", correct=True,
        query_positions=qpos.astype(np.int32), query_roles=roles,
        n_positions=cfg.positions, n_query=int(qpos.size))


def _record_attention_fields(path: Path, cfg: SynthConfig) -> None:
    """Add the attention variants' optional fields to ``model.json`` (atomically; a store
    resumed with other variants is refused, naming the field)."""
    fields = cfg.attention_fields()
    doc = json.loads((path / MODEL_FILE).read_text())
    for name in ("layer_attention", "attn_logit_softcap", "sinks"):
        if name in doc and doc[name] != fields.get(name):
            raise StoreError(f"{path / MODEL_FILE}: field {name!r} differs from the one asked "
                             "for (a store holds one model)")
    if fields and any(name not in doc for name in fields):
        doc.update(fields)
        atomic_write_bytes(path / MODEL_FILE, (json.dumps(doc, indent=2) + "\n").encode())


def write_synthetic_store(
    out: str | os.PathLike[str], cfg: SynthConfig,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write a synthetic trace store (normal format) and return its path.

    Memory is bounded by one layer of one sequence in the storage dtype plus a few
    ``queries x block`` float64 working arrays: attention is computed blocked over keys.
    Sequences already in the store are skipped (resume).

    Raises
    ------
    tracesim.store.StoreError
        If ``out`` is something other than an empty directory or a store of the same model.
    """
    path = Path(out)
    with TraceWriter(path, cfg.model(), o_proj=_o_proj(cfg)) as writer:
        _record_attention_fields(path, cfg)
        for s in range(cfg.sequences):
            sid = f"synth-{cfg.shape}-P{cfg.positions}-s{cfg.seed}-{s:04d}"
            if writer.has(sid):
                continue
            with writer.sequence(sid, **_row(cfg, s)) as sw:
                for layer in range(cfg.n_layers):
                    sw.add_layer(layer, **_layer(cfg, s, layer))
                    if progress is not None:
                        progress(f"{sid}: layer {layer + 1}/{cfg.n_layers}")
    return path
