"""What a score may look at: one layer of one sequence, in float64, with cached attention rows.

:class:`LayerTrace` is built by the replay engine from a trace store (or directly from arrays in
tests and in the impossibility demo). Scores receive it and never touch the store themselves, so
memory stays bounded by one layer's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracesim.prn import STREAM_PERTURBATION, permanent_uniforms

__all__ = ["LayerTrace"]


@dataclass
class LayerTrace:
    """One layer of one sequence, ready for scoring and replay.

    Attributes
    ----------
    layer : int
    keys, values : ndarray of float64, shape (n_kv_heads, n_positions, head_dim)
        Post-RoPE keys and values of every stored position.
    queries : ndarray of float64, shape (n_heads, n_query, head_dim)
        Queries at ``query_positions`` (every stored query position, all roles).
    outputs : ndarray of float64, shape (n_heads, n_query, head_dim), or None
        The model's stored full-cache outputs (checked against the float64 recomputation).
    h2o : ndarray of float64, shape (n_heads, n_positions)
        Accumulated post-softmax attention each key received from the prefill queries.
    query_positions : ndarray of int64, shape (n_query,)
    query_roles : list of str, length n_query
    prompt_length, question_start : int
        Token positions (see ``docs/trace-format.md``).
    scale : float
        Softmax scale of the model.
    o_proj : ndarray of float32 or float64, shape (hidden, n_heads * head_dim), or None
        :func:`tracesim.replay.load_layer` passes the store's float32 view unconverted.
    sequence_id : str
    meta : dict
        The manifest row (task, correctness, ...), passed through to results.
    rope : dict, optional
        The model's RoPE settings, ``{"rope_theta": float, "rope_scaling": dict}`` (from
        ``model.json``); ``None`` when the store does not record them.
    source : LayerTrace, optional
        The stored layer this trace is the per-query-head view of (:meth:`per_query_head`);
        ``None`` for a stored layer.
    window : int, optional
        Sliding-window layer: the query at position ``t`` attends ``(t - window, t]`` only;
        ``None`` for a full layer.
    softcap : float, optional
        Attention-logit soft-cap ``c``: logits are ``c * tanh(scale * q.k / c)``.
    sinks : ndarray of float64, shape (n_heads,), optional
        Learned per-query-head sink logits: ``exp(sink)`` enters the softmax denominator with
        value zero. ``None``: no sinks.
    """

    layer: int
    keys: np.ndarray
    values: np.ndarray
    queries: np.ndarray
    h2o: np.ndarray
    query_positions: np.ndarray
    query_roles: list[str]
    prompt_length: int
    question_start: int
    scale: float
    outputs: np.ndarray | None = None
    o_proj: np.ndarray | None = None
    sequence_id: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    rope: dict[str, Any] | None = None
    source: LayerTrace | None = field(default=None, repr=False, compare=False)
    window: int | None = None
    softcap: float | None = None
    sinks: np.ndarray | None = None
    _attention_cache: dict[tuple[int, int], np.ndarray] = field(
        default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        n_kv, P, d = self.keys.shape
        H = self.queries.shape[0]
        if self.values.shape != (n_kv, P, d):
            raise ValueError(f"values has shape {self.values.shape}, expected {(n_kv, P, d)}")
        if H % n_kv:
            raise ValueError(f"{H} query heads cannot share {n_kv} KV heads evenly")
        if self.queries.shape[1:] != (self.query_positions.size, d):
            raise ValueError("queries must have shape (n_heads, n_query, head_dim)")
        if self.h2o.shape != (H, P):
            raise ValueError(f"h2o has shape {self.h2o.shape}, expected {(H, P)}")
        if len(self.query_roles) != self.query_positions.size:
            raise ValueError("query_roles must be parallel to query_positions")
        if not 1 <= self.prompt_length <= P:
            raise ValueError(f"prompt_length = {self.prompt_length} outside [1, {P}]")
        if self.window is not None and (isinstance(self.window, bool) or self.window < 1):
            raise ValueError(f"window = {self.window!r}, expected None or an int >= 1")
        if self.softcap is not None and not (np.isfinite(self.softcap) and self.softcap > 0):
            raise ValueError(f"softcap = {self.softcap!r}, expected None or a float > 0")
        if self.sinks is not None:
            self.sinks = np.asarray(self.sinks, dtype=np.float64)
            if self.sinks.shape != (H,) or not np.isfinite(self.sinks).all():
                raise ValueError(f"sinks has shape {self.sinks.shape}, expected finite ({H},)")

    @property
    def attention_kind(self) -> str:
        """``"sliding"`` for a sliding-window layer, else ``"full"``."""
        return "full" if self.window is None else "sliding"

    @property
    def is_plain(self) -> bool:
        """Full attention without soft-cap or sinks (every stored layer before these existed)."""
        return self.window is None and self.softcap is None and self.sinks is None

    def sink(self, head: int) -> float | None:
        """Sink logit of query ``head``, or ``None``."""
        return None if self.sinks is None else float(self.sinks[head])

    def window_start(self, t: np.ndarray | int) -> np.ndarray | int:
        """First position the query at ``t`` attends: ``t - window + 1`` (>= 0), or 0."""
        if self.window is None:
            return np.zeros_like(t) if isinstance(t, np.ndarray) else 0
        return np.maximum(np.asarray(t) - self.window + 1, 0) if isinstance(
            t, np.ndarray) else max(int(t) - self.window + 1, 0)

    def logits(self, dots: np.ndarray) -> np.ndarray:
        """Logits from raw ``q . k`` products: scaled, then soft-capped when the layer is."""
        s = dots * self.scale
        if self.softcap is not None:
            s = self.softcap * np.tanh(s / self.softcap)
        return s

    @property
    def n_kv_heads(self) -> int:
        return self.keys.shape[0]

    @property
    def n_heads(self) -> int:
        return self.queries.shape[0]

    @property
    def n_positions(self) -> int:
        return self.keys.shape[1]

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def stored_group_size(self) -> int:
        """Query heads per KV head of the stored layer (of :attr:`source` for a view)."""
        return (self.source or self).group_size

    def per_query_head(self) -> LayerTrace:
        """The layer seen as multi-head attention: query head ``h`` paired with its own copy
        of KV head ``h // G``'s keys and values (``n_kv_heads = n_heads``, group size 1).

        A design that draws one sample per query head (``perstep`` with ``gqa: head``) is
        replayed on this view, so every kernel and certificate runs unchanged with one sample
        per (view) KV head; the random numbers' head coordinate is then the query head. The
        view holds ``G`` times the layer's keys and values (float64) and remembers the stored
        layer in :attr:`source`; a layer whose group size is already 1 is its own view.

        Returns
        -------
        LayerTrace
        """
        G = self.group_size
        if G == 1:
            return self
        return LayerTrace(
            layer=self.layer, keys=np.repeat(self.keys, G, axis=0),
            values=np.repeat(self.values, G, axis=0), queries=self.queries, h2o=self.h2o,
            query_positions=self.query_positions, query_roles=self.query_roles,
            prompt_length=self.prompt_length, question_start=self.question_start,
            scale=self.scale, outputs=self.outputs, o_proj=self.o_proj,
            sequence_id=self.sequence_id, meta=self.meta, rope=self.rope, source=self,
            window=self.window, softcap=self.softcap, sinks=self.sinks)

    def group(self, kv_head: int) -> range:
        """Query heads sharing ``kv_head``."""
        G = self.group_size
        return range(kv_head * G, (kv_head + 1) * G)

    def role_indices(self, role: str, before: int | None = None) -> np.ndarray:
        """Indices into ``query_positions`` of the ``role`` queries, optionally ``< before``."""
        idx = np.array([i for i, r in enumerate(self.query_roles) if r == role], dtype=np.int64)
        if before is not None and idx.size:
            idx = idx[self.query_positions[idx] < before]
        return idx

    def indices_before(self, end: int) -> np.ndarray:
        """Indices of every stored query at a position ``< end``."""
        return np.flatnonzero(self.query_positions < end)

    def attention(self, head: int, index: int) -> np.ndarray:
        """Full-cache softmax attention of stored query ``index`` of ``head``, shape (P,).

        Causal: zero beyond the query's position, and before its window on a sliding layer;
        soft-capped logits; a sink's share ``1 - sum`` is the weight left to no token.
        Float64, cached per (head, index).
        """
        return self._attention_rows(head, [int(index)])[0]

    def _attention_rows(self, head: int, indices) -> list[np.ndarray]:
        """:meth:`attention` of several queries of one head; the missing rows in one kernel call."""
        idx = self._query_indices(indices)
        self._compute_rows([head], idx)
        return [self._attention_cache[(int(head), i)] for i in idx]

    def _query_indices(self, indices) -> list[int]:
        """``indices`` into the stored queries as non-negative ints (the kernel does not check
        its indices)."""
        nq = self.query_positions.size
        idx = [int(i) for i in indices]
        for i in idx:
            if not -nq <= i < nq:
                raise IndexError(f"stored query {i}: outside the {nq} stored queries")
        return [i + nq if i < 0 else i for i in idx]

    def _compute_rows(self, heads, idx: list[int]) -> None:
        """Compute and cache the missing attention rows of ``heads`` x ``idx`` (non-negative
        indices) in one call, in parallel over the rows when there is enough work."""
        missing = [(int(h), i) for h in heads for i in sorted(set(idx))
                   if (int(h), i) not in self._attention_cache]
        if not missing:
            return
        for h, _ in missing:
            if not 0 <= h < self.n_heads:
                raise IndexError(f"query head {h}: outside the {self.n_heads} heads")
        # compiled: one pass per row, no full-size temporaries (imported here so that reading
        # a trace does not load numba)
        from tracesim.kernels.attention import LogitRule
        from tracesim.kernels.attention_rows import head_rows

        rows = np.zeros((len(missing), self.n_positions))
        rule = LogitRule(float(self.scale), float(self.softcap or 0.0), int(self.window or 0))
        sinks = (np.full(self.n_heads, -np.inf) if self.sinks is None
                 else np.asarray(self.sinks, dtype=np.float64))
        head_rows(np.ascontiguousarray(self.keys, dtype=np.float64),
                  np.ascontiguousarray(self.queries, dtype=np.float64),
                  np.array([h for h, _ in missing], dtype=np.int64),
                  np.array([i for _, i in missing], dtype=np.int64),
                  np.ascontiguousarray(self.query_positions, dtype=np.int64), rule, sinks, rows)
        for j, key in enumerate(missing):
            self._attention_cache[key] = rows[j]

    def group_attention(self, kv_head: int, indices: np.ndarray) -> np.ndarray:
        """Mean attention over the group's heads and the given queries, shape (P,)."""
        acc = np.zeros(self.n_positions)
        heads = self.group(kv_head)
        idx = self._query_indices(indices)
        self._compute_rows(heads, idx)  # the whole group's rows in one call
        for h in heads:
            for i in idx:
                acc += self._attention_cache[(h, i)]
        return acc / max(1, len(heads) * len(indices))

    def perturbation_uniforms(self, seed: int, kv_head: int, end: int) -> np.ndarray:
        """Permanent uniforms of stream 1 (perturbations) for positions ``[0, end)``."""
        return permanent_uniforms(seed, self.layer, kv_head, np.arange(end),
                                  stream=STREAM_PERTURBATION)
