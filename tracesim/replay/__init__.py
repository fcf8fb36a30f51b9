"""Replay eviction policies over recorded traces, without re-running the model.

>>> from tracesim.store import open_store
>>> from tracesim.policies import policy_grid
>>> table = replay(open_store("traces/"), policy_grid(["snapkv"], ["topk", "poisson"],
...                [0.25]), seeds=64)                                    # doctest: +SKIP

For each (sequence, layer) the engine loads the layer's K/V/Q in float64, computes the logits
and the full-cache outputs once, builds every policy's inclusion probabilities, and replays all
(policy, seed) pairs in one compiled parallel loop. See ``docs/replay.md``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from tracesim.layer_trace import LayerTrace
from tracesim.policies import Policy
from tracesim.replay.engine import (
    OUTPUT_CHECK_TOLERANCE,
    LayerResult,
    ReplayOptions,
    ReplaySetup,
    evaluated_queries,
    replay_layer,
    replay_layer_runs,
)
from tracesim.replay.results import (
    BATCH_ROWS,
    BOOTSTRAP_COLUMNS,
    METRICS,
    RESULT_COLUMNS,
    LayerColumns,
    columns_batch,
    layer_batch,
    layer_columns,
    result_schema,
)

__all__ = [
    "BOOTSTRAP_COLUMNS", "METRICS", "RESULT_COLUMNS", "LayerResult", "ReplayOptions", "ReplaySetup",
    "evaluated_queries",
    "iter_replay", "layer_batch", "load_layer", "replay", "replay_layer", "replay_layer_runs",
    "result_schema", "verify_sequence",
]


def load_layer(store, seq, layer: int) -> LayerTrace:
    """Read one layer of one sequence from a trace store into a :class:`LayerTrace` of float64
    tensors (``o_proj`` stays the store's float32 view)."""
    m = store.model
    meta = dict(seq.meta)
    o_proj = store.o_proj(layer)
    attn = store.layer_attention(layer)
    trace = LayerTrace(
        layer=int(layer),
        keys=_float64_stack([seq.keys(layer, g) for g in range(m.n_kv_heads)]),
        values=_float64_stack([seq.values(layer, g) for g in range(m.n_kv_heads)]),
        queries=_float64_stack([seq.queries(layer, h) for h in range(m.n_heads)]),
        outputs=_float64_stack([seq.outputs(layer, h) for h in range(m.n_heads)]),
        h2o=_float64_stack([seq.h2o_scores(layer, h) for h in range(m.n_heads)]),
        query_positions=np.asarray(seq.query_positions, dtype=np.int64),
        query_roles=list(seq.query_roles),
        prompt_length=int(meta["prompt_length"]),
        question_start=int(meta["question_start"]),
        scale=float(m.scaling),
        # the store's float32 view: only the output space reads it (gram_blocks converts
        # it once per layer and caches the result), so a replay without it converts nothing
        o_proj=o_proj,
        sequence_id=str(seq.sequence_id),
        meta=meta,
        rope=m.rope(layer),
        window=attn.window, softcap=attn.softcap, sinks=attn.sinks,
    )
    _check_finite(trace, seq.file, o_proj is not None)
    return trace


def _float64_stack(parts: list[np.ndarray]) -> np.ndarray:
    """The equally shaped stored tensors ``parts`` as one float64 array: each converted
    straight into its slot (``np.stack`` of float64 copies converts, then copies again: for one
    layer's float16 keys 2.4 ms against 0.4 ms, measured under load)."""
    out = np.empty((len(parts),) + parts[0].shape, dtype=np.float64)
    for i, part in enumerate(parts):
        out[i] = part
    return out


def _check_finite(trace: LayerTrace, label: str, o_proj: bool) -> None:
    """Stored tensors must be finite (a writer never stores NaN/Inf; a damaged store might)."""
    from tracesim.store import StoreError

    fields = ["keys", "values", "queries", "outputs", "h2o"] + (["o_proj"] if o_proj else [])
    for name in fields:
        arr = getattr(trace, name)
        if not np.isfinite(arr).all():
            where = "o_proj.arrow" if name == "o_proj" else label
            raise StoreError(f"{where}: field {name!r} of layer {trace.layer} holds NaN/Inf, "
                             "expected finite values (damaged store? run tracesim validate)")


def verify_sequence(store, seq, checksum: bool = True) -> None:
    """:meth:`TraceSequence.verify`, remembered per store for unchanged files (a sweep worker
    verifies each sequence file once, however many tasks read it)."""
    import os

    st = os.stat(seq.path) if os.path.isfile(seq.path) else None
    key = (seq.sequence_id, checksum, None if st is None else
           (st.st_ino, st.st_size, st.st_mtime_ns))
    cache = store.__dict__.setdefault("_verified", set())
    if key in cache:
        return
    seq.verify(checksum=checksum)
    cache.add(key)


def _seeds(seeds: int | Sequence[int]) -> np.ndarray:
    if isinstance(seeds, (int, np.integer)):
        if seeds < 1:
            raise ValueError(f"seeds = {seeds}: expected at least 1")
        return np.arange(int(seeds), dtype=np.int64)
    arr = np.asarray(list(seeds), dtype=np.int64)
    if arr.ndim != 1 or arr.size == 0 or np.unique(arr).size != arr.size:
        raise ValueError("seeds must be a positive int or a non-empty list of distinct ints")
    return arr


def iter_replay(
    store,
    configs: Iterable[Policy],
    *,
    seeds: int | Sequence[int] = 32,
    layers: Sequence[int] | None = None,
    sequences: Sequence[str] | None = None,
    per_seed: bool = False,
    progress: bool = True,
    options: ReplayOptions | None = None,
    verify: str = "checksum",
    skip_damaged: bool = False,
    skipped: list[str] | None = None,
) -> Iterator[pa.RecordBatch]:
    """Replay lazily: record batches of the rows of consecutive layers of one sequence (at
    least :data:`~tracesim.replay.results.BATCH_ROWS` rows, or the rest of the sequence), in
    the order of the layers and, within a layer, of the policies (a list that mixes ``gqa:
    head`` with other policies is replayed in runs,
    :func:`tracesim.replay.engine.replay_layer_runs`).

    Arguments as :func:`replay`, plus: ``verify`` (``"checksum"``: structure and sha256 of each
    sequence file before its first use; ``"structure"``: sizes, index and manifest row only),
    ``skip_damaged`` (skip a sequence that fails verification instead of raising
    :class:`~tracesim.store.StoreError`) and ``skipped`` (a list that receives one message per
    skipped sequence).
    """
    if verify not in ("checksum", "structure"):
        raise ValueError(f"verify = {verify!r}: expected 'checksum' or 'structure'")
    policies = list(configs)
    if not policies or not all(isinstance(p, Policy) for p in policies):
        raise ValueError("configs must be a non-empty list of Policy objects")
    ids = [p.id for p in policies]
    if len(set(ids)) != len(ids):
        raise ValueError("configs contain duplicate policies (same id)")
    seed_arr = _seeds(seeds)
    n_layers = store.model.n_layers
    layer_list = list(range(n_layers)) if layers is None else [int(x) for x in layers]
    for layer in layer_list:
        if not 0 <= layer < n_layers:
            raise ValueError(f"layer {layer} outside [0, {n_layers})")
    seq_ids = list(store.sequence_ids) if sequences is None else list(sequences)
    missing = [s for s in seq_ids if s not in store]
    if missing:
        raise ValueError(f"sequences not in the store: {missing[:5]}")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(seq_ids) * len(layer_list), unit="layer", desc="replay")
    bad: list[tuple[str, int, float]] = []
    # Quantiles once per replay; o_proj's Gram blocks and QR factor once per store object (its
    # o_proj file is checked and mapped once, so they cannot change under it).
    setup = ReplaySetup(options, gram_cache=getattr(store, "gram_cache", None))
    try:
        for sid in seq_ids:
            seq = store[sid]
            try:
                verify_sequence(store, seq, checksum=verify == "checksum")
            except ValueError as exc:
                if not skip_damaged:
                    raise
                if skipped is not None:
                    skipped.append(str(exc))
                if bar is not None:
                    bar.update(len(layer_list))
                continue
            pending: list[LayerColumns] = []
            for layer in layer_list:
                trace = load_layer(store, seq, layer)
                # The rows of each run of policies sharing a sample layout (per KV head or per
                # query head), in the order of the policies.
                for result in replay_layer_runs(trace, policies, seed_arr, n_layers,
                                                setup=setup):
                    if result.output_check_relative > OUTPUT_CHECK_TOLERANCE:
                        bad.append((sid, layer, result.output_check_relative))
                    pending.append(layer_columns(result, per_seed=per_seed))
                if sum(part.n_rows for part in pending) >= BATCH_ROWS:
                    yield columns_batch(pending)
                    pending = []
                if bar is not None:
                    bar.update(1)
            if pending:
                yield columns_batch(pending)
            seq.close()
    finally:
        if bar is not None:
            bar.close()
    if bad:
        # fp16 stores agree to ~5e-3 of |o| (rounded Q/K/V); far more means a broken trace.
        sid, layer, worst = max(bad, key=lambda b: b[2])
        warnings.warn(f"{len(bad)} (sequence, layer) pairs have stored outputs that differ from "
                      f"the float64 recomputation by more than {OUTPUT_CHECK_TOLERANCE} x |o| "
                      f"(worst {worst:.3g} in {sid!r} layer {layer}); errors are measured "
                      f"against the recomputation (column output_check)", stacklevel=2)


def replay(
    store,
    configs: Iterable[Policy],
    seeds: int | Sequence[int] = 32,
    layers: Sequence[int] | None = None,
    sequences: Sequence[str] | None = None,
    per_seed: bool = False,
    progress: bool = True,
    options: ReplayOptions | None = None,
) -> pa.Table:
    """Replay policies over a trace store and return the results table.

    Parameters
    ----------
    store : tracesim.store.TraceStore or path
        An open store (or a path given to :func:`tracesim.store.open_store`).
    configs : iterable of Policy
        Policies to replay (see :func:`tracesim.policies.policy_grid`).
    seeds : int or sequence of int, default 32
        Number of seeds (``0..n-1``) or the seeds themselves. Deterministic policies use one.
    layers, sequences : optional
        Subsets of layers / sequence ids (default: all).
    per_seed : bool, default False
        One row per seed instead of aggregating over seeds.
    progress : bool, default True
        Show a tqdm progress bar over (sequence, layer).
    options : ReplayOptions, optional

    Returns
    -------
    pyarrow.Table
        Columns :data:`RESULT_COLUMNS` (documented in ``docs/replay.md``), then
        :data:`BOOTSTRAP_COLUMNS` when ``options.bootstrap > 0``.
    """
    if isinstance(store, (str, bytes)) or hasattr(store, "__fspath__"):
        from tracesim.store import open_store

        store = open_store(store)
    batches = list(iter_replay(store, configs, seeds=seeds, layers=layers, sequences=sequences,
                               per_seed=per_seed, progress=progress, options=options))
    boot = options is not None and options.bootstrap > 0
    return pa.Table.from_batches(batches, schema=result_schema(boot))
