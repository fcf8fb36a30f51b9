"""Replay results as Arrow record batches: one row per (sequence, layer, head, query, policy).

By default rows aggregate the seeds (means, plus ``n_seeds``); ``per_seed=True`` gives one row
per seed instead. Every row carries its full configuration (:data:`POLICY_COLUMNS`).
Deterministic policies are replayed once (``n_seeds = 1``; their ``seed`` is null). Values that do
not apply are Parquet nulls (see :mod:`tracesim.columns` and ``docs/columns.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import pyarrow as pa

from tracesim.columns import METRIC_DOCS, describe_schema, strings_from_runs, to_arrow
from tracesim.interval_events import satterthwaite_quantile
from tracesim.kernels import bounds as KB
from tracesim.kernels import replay as K
from tracesim.kernels import replay_bootstrap as KBOOT
from tracesim.policies import POLICY_COLUMNS
from tracesim.replay.engine import LayerResult

__all__ = ["BATCH_ROWS", "BOOTSTRAP_COLUMNS", "METRICS", "RESULT_COLUMNS", "LayerColumns",
           "columns_batch", "layer_batch", "layer_columns", "result_schema", "store_identity",
           "write_replay_dataset"]

#: Metric columns: name -> (kernel field or None, description). Means over seeds unless noted.
#: The descriptions (and the order) are :data:`tracesim.columns.METRIC_DOCS`; the kernel
#: fields are this module's.
_METRIC_FIELDS: dict[str, int] = {
    "err2": K.F_ERR2,
    "rel_err": K.F_REL,
    "cert2": K.F_CERT2,
    "cert2_small": K.F_CERT2_SMALL,
    "tail_size": K.F_TAIL,
    "n_eff": K.F_NEFF,
    "wald_cov": K.F_WALD,
    "wald_t_cov": K.F_WALD_T,
    "kept_tokens": K.F_KEPT,
    "expected_kept": K.F_EXPECTED,
    "tail_population": K.F_POP,
    "tail_out_mass": K.F_OUT_MASS,
    "tail_out_max": K.F_OUT_MAX,
    "evicted_mass": K.F_EV_MASS,
    "evicted_max": K.F_EV_MAX,
    "max_tail_weight": K.F_MAX_TAIL,
}
METRICS: dict[str, tuple[int | None, str]] = {
    name: (_METRIC_FIELDS.get(name), doc) for name, doc in METRIC_DOCS.items()}

#: Every column in order, with its Arrow type.
RESULT_COLUMNS: dict[str, pa.DataType] = {
    "sequence_id": pa.string(), "task": pa.string(), "correct": pa.bool_(),
    "layer": pa.int32(), "head": pa.int32(), "kv_head": pa.int32(),
    "query_index": pa.int32(), "query_position": pa.int32(), "query_role": pa.string(),
    "prompt_length": pa.int32(), "n_positions": pa.int32(),
    "attention_kind": pa.string(), "layer_window": pa.int32(),
    **{c: (pa.string() if c in ("config_id", "score", "design", "correction", "budget_unit",
                                  "allocator", "schedule", "design_kind", "design_params",
                                  "score_params")
           else pa.bool_() if c in ("certified", "deployable")
           else pa.int32() if c in ("every", "sinks", "window", "summary_page")
           else pa.float64())
       for c in POLICY_COLUMNS},
    "seed": pa.int64(), "n_seeds": pa.int32(), "event": pa.int32(),
    "context_tokens": pa.int32(), "nominal_tokens": pa.int32(), "budget_tokens": pa.float64(),
    "truth_norm": pa.float64(), "output_check": pa.float64(),
    **{name: pa.float64() for name in METRICS},
}


#: Columns written after :data:`RESULT_COLUMNS` only when ``ReplayOptions.bootstrap > 0``
#: (descriptions in :data:`tracesim.columns.BOOTSTRAP_DOCS`).
BOOTSTRAP_COLUMNS: dict[str, pa.DataType] = {"boot_cov": pa.float64(),
                                             "boot_cert2": pa.float64()}


def _columns(bootstrap: bool) -> dict[str, pa.DataType]:
    return {**RESULT_COLUMNS, **BOOTSTRAP_COLUMNS} if bootstrap else RESULT_COLUMNS


def _satterthwaite(out: np.ndarray, lerr: np.ndarray, alpha: float) -> tuple[np.ndarray, ...]:
    """Per-seed Satterthwaite coverage (NaN where tr V^2 was not computed)."""
    tr, tr2, err2 = out[..., K.F_CERT2], out[..., K.F_TRV2], out[..., K.F_ERR2]
    m, pop = out[..., K.F_TAIL], out[..., K.F_POP]
    ok = np.isfinite(tr2) & (pop > 0)
    if not ok.any():  # satterthwaite off: skip the chi-square quantiles
        nan = np.full(ok.shape, np.nan)
        return nan, nan.copy()
    with np.errstate(invalid="ignore", divide="ignore"):
        q = satterthwaite_quantile(np.where(ok, tr, 0.0), np.where(ok, tr2, 1.0), alpha)
        factor = np.where(m > 1, m / np.maximum(m - 1, 1), np.inf)
        qt = np.where(np.isnan(q * factor), np.inf, q * factor)
    cov = np.where(ok, (err2 <= q).astype(float), np.nan)
    cov_t = np.where(ok, (err2 <= qt).astype(float), np.nan)
    return cov, cov_t


def _bound_metrics(result: LayerResult) -> dict[str, np.ndarray]:
    """Per-iteration ``bound2``, ``bound_cov``, ``bound_mass``, ``summary_tokens`` (NaN: none)."""
    shape = result.out.shape[:3]
    if result.bounds is None:
        nan = np.full(shape, np.nan)
        return {"bound2": nan, "bound_cov": nan, "bound_mass": nan, "summary_tokens": nan}
    b = result.bounds
    bound2 = b[..., KB.B_BOUND] ** 2
    with np.errstate(invalid="ignore"):
        cov = np.where(np.isnan(bound2), np.nan,
                       (result.out[..., K.F_ERR2] <= bound2).astype(float))
    return {"bound2": bound2, "bound_cov": cov, "bound_mass": b[..., KB.B_MASS],
            "summary_tokens": b[..., KB.B_TOKENS]}


#: Columns constant over runs of rows (a policy's, a seed group's or a layer's values) and
#: the query roles: kept as (value, run length) pairs and expanded once per batch.
_RUN_COLUMNS = frozenset({"sequence_id", "task", "correct", "layer", "prompt_length",
                          "n_positions", "attention_kind", "layer_window", "query_role",
                          "seed", "n_seeds", "context_tokens", "nominal_tokens",
                          *POLICY_COLUMNS})
#: Rows a replay batch collects from consecutive layers of one sequence before it is built:
#: each of the 68 columns costs a fixed tens of microseconds per Arrow array, which one
#: layer's few rows (63 at 9 heads x 7 queries) do not amortise.
BATCH_ROWS = 1 << 16


@dataclass
class LayerColumns:
    """The result columns of one replayed layer, not yet Arrow arrays (:func:`layer_columns`).

    Attributes
    ----------
    n_rows : int
    arrays : dict of str to list of ndarray
        Per-row columns, in pieces to concatenate.
    runs : dict of str to (list, list of int)
        Columns of :data:`_RUN_COLUMNS`: each value and how many rows in turn carry it.
    bootstrap : bool
        Whether the bootstrap columns are present.
    """

    n_rows: int
    arrays: dict[str, list[np.ndarray]]
    runs: dict[str, tuple[list[Any], list[int]]]
    bootstrap: bool


def layer_columns(result: LayerResult, per_seed: bool = False) -> LayerColumns:
    """The rows of one replayed layer as column pieces; :func:`columns_batch` builds several
    layers' pieces into one Arrow batch."""
    tr = result.trace
    tabs = result.tables
    H, NQ = tr.n_heads, result.query_positions.size
    G = tr.group_size
    out, lout = result.out, result.lout
    sat, sat_t = _satterthwaite(out, lout, result.options.alpha)
    # Nominal budget of each (iteration, head, query) from its event and KV head (the query
    # head itself on a per-query-head view, where G = 1).
    ev_global = tabs.slot_ev[tabs.it_slot][:, None, None] + out[..., K.F_EVENT].astype(np.int64)
    kv_of_head = np.arange(H) // G
    budget = tabs.budget_tokens[ev_global, kv_of_head[None, :, None]].astype(np.float64)
    per_it = {name: out[..., f] for name, (f, _) in METRICS.items() if f is not None}
    per_it.update(sat_cov=sat, sat_t_cov=sat_t, budget_tokens=budget,
                  layer_err2=np.broadcast_to(lout[:, None, :, K.L_ERR2], out.shape[:3]),
                  layer_cert2=np.broadcast_to(lout[:, None, :, K.L_CERT2], out.shape[:3]))
    per_it.update(_bound_metrics(result))
    bootstrap = result.boot is not None
    if bootstrap:
        per_it.update(boot_cov=result.boot[..., KBOOT.B_COV],
                      boot_cert2=result.boot[..., KBOOT.B_CERT2])
    # Rows aggregate contiguous iterations: all seeds of one policy (or one seed each).
    n_it = tabs.it_cfg.size
    starts = (np.arange(n_it) if per_seed
              else np.r_[0, np.flatnonzero(np.diff(tabs.it_cfg)) + 1].astype(np.int64))
    sizes = np.diff(np.r_[starts, n_it])
    n_groups = starts.size

    def aggregate(values: np.ndarray) -> np.ndarray:
        """Each group's mean over its iterations, the groups' rows one after the other."""
        if per_seed:
            return np.ascontiguousarray(values).reshape(-1)
        return np.concatenate([values[a:a + n].mean(axis=0).reshape(-1)
                               for a, n in zip(starts.tolist(), sizes.tolist(), strict=True)])

    arrays: dict[str, list[np.ndarray]] = {name: [] for name in _columns(bootstrap)
                                           if name not in _RUN_COLUMNS}
    runs: dict[str, tuple[list[Any], list[int]]] = {name: ([], []) for name in _RUN_COLUMNS}
    n_rows = H * NQ
    field_means = aggregate(out).reshape(n_groups, H, NQ, out.shape[3])
    for name, values in per_it.items():
        field = METRICS.get(name, (None, ""))[0]
        arrays[name].append(field_means[..., field].reshape(-1) if field is not None
                            else aggregate(values))
    if per_seed:
        arrays["err2_sd"].append(np.full(n_groups * n_rows, np.nan))
    else:
        err2 = out[..., K.F_ERR2]
        arrays["err2_sd"].append(np.concatenate([
            err2[a:a + n].std(axis=0, ddof=1).reshape(-1) if n > 1 else np.full(n_rows, np.nan)
            for a, n in zip(starts.tolist(), sizes.tolist(), strict=True)]))
    arrays["event"].append(out[starts, ..., K.F_EVENT].reshape(-1).astype(np.int64))
    head = np.repeat(np.arange(H), NQ)
    qi = np.tile(np.arange(NQ), H)
    arrays["head"].append(np.tile(head, n_groups))
    arrays["kv_head"].append(np.tile(head // tr.stored_group_size, n_groups))  # stored layer
    arrays["query_index"].append(np.tile(result.query_index[qi], n_groups))
    arrays["query_position"].append(np.tile(result.query_positions[qi], n_groups))
    arrays["truth_norm"].append(np.tile(result.truth_norm.reshape(-1), n_groups))
    arrays["output_check"].append(np.tile(result.output_check.reshape(-1), n_groups))
    # The query roles of one group's rows (head-major), as runs.
    roles = np.asarray(result.query_roles, dtype=object)[qi]
    role_starts = np.flatnonzero(np.r_[True, roles[1:] != roles[:-1]]) if n_rows else \
        np.zeros(0, np.int64)
    runs["query_role"][0].extend(list(roles[role_starts]) * n_groups)
    runs["query_role"][1].extend(np.diff(np.r_[role_starts, n_rows]).tolist() * n_groups)
    rows = [p.row() for p in result.policies]

    def add_run(name: str, value: Any, length: int) -> None:
        values, lengths = runs[name]
        if values and type(values[-1]) is type(value) and values[-1] == value:
            lengths[-1] += length  # consecutive seeds of one policy: one run
        else:
            values.append(value)
            lengths.append(length)

    for start, size in zip(starts.tolist(), sizes.tolist(), strict=True):
        c = int(tabs.it_cfg[start])
        policy = result.policies[c]
        seed = int(result.seeds[tabs.it_seed[start]]) if policy.needs_seeds else -1
        add_run("seed", seed if per_seed else -1, n_rows)
        add_run("n_seeds", size, n_rows)
        add_run("context_tokens", tabs.context[c], n_rows)
        add_run("nominal_tokens", tabs.nominal[c], n_rows)
        for key, value in rows[c].items():
            add_run(key, value, n_rows)
    n_total = n_rows * n_groups
    meta = tr.meta
    const = {"sequence_id": tr.sequence_id, "task": str(meta.get("task", "")),
             "correct": None if meta.get("correct") is None else bool(meta["correct"]),
             "layer": tr.layer,
             "prompt_length": tr.prompt_length, "n_positions": tr.n_positions,
             "attention_kind": tr.attention_kind, "layer_window": int(tr.window or 0)}
    for name, value in const.items():
        add_run(name, value, n_total)
    return LayerColumns(n_total, arrays, runs, bootstrap)


def _expand_runs(name: str, values: list[Any], lengths: list[int],
                 typ: pa.DataType) -> pa.Array:
    """The Arrow column of ``lengths[i]`` rows of ``values[i]`` in turn (nulls per
    :func:`tracesim.columns.to_arrow`)."""
    if pa.types.is_string(typ) and all(v is None or isinstance(v, str) for v in values):
        direct = strings_from_runs(name, values, np.asarray(lengths, dtype=np.int64))
        if direct is not None:
            return direct
    as_object = any(isinstance(v, str) for v in values)
    column = np.repeat(np.asarray(values, dtype=object if as_object else None),
                       np.asarray(lengths, dtype=np.int64))
    return to_arrow(name, column, typ)


def columns_batch(parts: list[LayerColumns]) -> pa.RecordBatch:
    """One Arrow batch of the rows of ``parts`` in turn (see :data:`RESULT_COLUMNS`)."""
    if not parts:
        raise ValueError("columns_batch: no layer columns")
    bootstrap = parts[0].bootstrap
    if any(p.bootstrap != bootstrap for p in parts):
        raise ValueError("columns_batch: parts with and without the bootstrap columns")
    arrays = []
    for name, typ in _columns(bootstrap).items():
        if name in _RUN_COLUMNS:
            column = _expand_runs(name, [v for p in parts for v in p.runs[name][0]],
                                  [n for p in parts for n in p.runs[name][1]], typ)
        else:
            # Not applicable (NaN, seed -1, every 0, "") becomes a Parquet null.
            column = to_arrow(name, np.concatenate([a for p in parts for a in p.arrays[name]]),
                              typ)
        arrays.append(column)
    return pa.RecordBatch.from_arrays(arrays, schema=result_schema(bootstrap))


def layer_batch(result: LayerResult, per_seed: bool = False) -> pa.RecordBatch:
    """Arrow rows of one replayed layer (see :data:`RESULT_COLUMNS`)."""
    return columns_batch([layer_columns(result, per_seed)])


# Built once per flag: every replayed layer's batch carries it (a described schema of 68 fields
# costs about a millisecond, paid per layer before); Arrow schemas are immutable.
@lru_cache(maxsize=2)
def result_schema(bootstrap: bool = False) -> pa.Schema:
    """Arrow schema of replay results, every field with its description; ``bootstrap`` adds
    :data:`BOOTSTRAP_COLUMNS` (``ReplayOptions.bootstrap > 0``)."""
    return describe_schema(pa.schema([pa.field(n, t) for n, t in _columns(bootstrap).items()]))


def store_identity(store) -> dict[str, str]:
    """What identifies a trace store's contents in a run id: the sha256 of its model and
    manifest files (a store rebuilt in place gets another run id, so no part is resumed)."""
    from pathlib import Path

    from tracesim.digests import sha256_file
    from tracesim.store.format import MANIFEST_FILE, MODEL_FILE

    root = Path(store.path)
    return {name: sha256_file(root / name, "trace store file")
            for name in (MODEL_FILE, MANIFEST_FILE) if (root / name).is_file()}


def write_replay_dataset(out, store, policies: list, *, seeds, layers, sequences, per_seed: bool,
                         options, run_doc: dict, summary_doc, extra_files: dict[str, bytes],
                         progress: bool = False, skip_damaged: bool = False,
                         skipped: list[str] | None = None) -> tuple[int, int]:
    """Replay into the results dataset ``OUT/results`` (:mod:`tracesim.dataset`): one part per
    sequence, written as it finishes, in the order of the sequences (so the rows do not depend
    on the number of threads); a rerun with the same ``run_doc`` (inputs and options) keeps the
    parts already written. Returns (rows, parts resumed).

    Raises
    ------
    ValueError
        No rows at all (e.g. every sequence skipped as damaged); nothing is published then.
    """
    from tracesim.dataset import PartWriter, publish, run_id_of, schema_doc
    from tracesim.replay import iter_replay

    seq_ids = list(store.sequence_ids) if sequences is None else list(sequences)
    schema = result_schema(options.bootstrap > 0)
    run_id = run_id_of(run_doc)
    writer = PartWriter(out, run_id, schema, width=max(5, len(str(len(seq_ids) - 1))))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(seq_ids), unit="sequence", desc="replay")
    entries, resumed = [], 0
    store_name = store.path.resolve().name
    try:
        for i, sid in enumerate(seq_ids):
            key = f"replay/{sid}"
            entry = writer.finished(i, key)
            if entry is not None:
                resumed += 1
            else:
                entry = writer.write(
                    i, key, iter_replay(store, policies, seeds=seeds, layers=layers,
                                        sequences=[sid], per_seed=per_seed, progress=False,
                                        options=options, skip_damaged=skip_damaged,
                                        skipped=skipped),
                    store=store_name, sequence_id=sid)
            if entry is not None:
                entries.append(entry)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    if not entries:
        raise ValueError(f"{store.path}: the replay produced 0 rows (skipped: "
                         f"{len(skipped or [])} damaged sequence(s)), expected at least one "
                         "row; the earlier results are kept")
    from tracesim.integrity import KEY_COLUMNS

    rows = publish(out, writer.build, entries, schema=schema_doc(schema),
                   config_ids=[p.id for p in policies], run={"run_id": run_id},
                   summary_doc=summary_doc, key_columns=KEY_COLUMNS, extra_files=extra_files)
    return rows, resumed
