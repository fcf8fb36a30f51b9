"""Column descriptions and null encoding shared by every Parquet table tracesim writes.

"Not applicable" is a Parquet **null**, never NaN or a sentinel. :func:`to_arrow` turns the
in-memory conventions (NaN in float columns, ``-1`` seeds, ``0`` for ``every`` without a
decode schedule, ``""`` in configuration strings, empty ``certificate_by_layer`` lists) into
nulls, so code that adds a float column only needs NaN for "not applicable". Every field
carries its description in the Arrow field metadata (key ``description``);
``docs/columns.md`` is the reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["BOOTSTRAP_DOCS", "COLUMN_DOCS", "DESCRIPTION_KEY", "INT_SENTINELS", "METRIC_DOCS",
           "describe_schema", "describe_table", "description", "nullify_rows",
           "strings_from_runs", "to_arrow"]

DESCRIPTION_KEY = b"description"

#: Integer sentinels that mean "not applicable" in memory: column -> value.
INT_SENTINELS: dict[str, int] = {"seed": -1, "every": 0, "layer_window": 0}
#: String columns whose empty string means "not applicable" (an empty answer is a value).
EMPTY_STRING_NULL = frozenset({"budget_unit", "allocator", "design_kind", "design_params",
                               "task"})

#: Descriptions of every column of replay results, sweep results and evict outcomes.
COLUMN_DOCS: dict[str, str] = {
    # identification
    "store": "label of the trace store (sweep results)",
    "model_id": "model that produced the traces (sweep results)",
    "sequence_id": "id of the recorded sequence in its store",
    "task": "task of the sequence (e.g. passkey); null if unknown",
    "correct": "whether the answer was graded correct (full-cache run in replay rows, the "
               "evicted run in outcomes)",
    "layer": "decoder layer index (0-based)",
    "head": "query head index",
    "kv_head": "KV head of the query head (head // group size)",
    "query_index": "index of the query in the sequence's recorded query positions",
    "query_position": "token position of the query",
    "query_role": "role of the query: context_window, question_window, decode or all",
    "prompt_length": "prompt tokens of the sequence",
    "n_positions": "stored positions (prompt + generated tokens)",
    "attention_kind": "how the layer attends: full, or sliding (a window of layer_window "
                      "positions, model.json field layer_attention)",
    "layer_window": "the sliding layer's window w: its query at t attends (t - w, t]; null for "
                    "a full layer",
    # configuration
    "config_id": "stable id of the policy (score|design|correction|budget|schedule)",
    "score": "importance score (streaming, h2o, snapkv, tova, knorm, vnorm, keyformer, vase, "
             "headroles, tangram, perstep, random, oracle, full, the kvpress ports, or a "
             "plugin's name)",
    "design": "inclusion design (topk, poisson, bernoulli, fixed; none for full)",
    "correction": "estimator correction: hajek or none",
    "budget": "budget value: a fraction of the compressible range or a token count; null "
              "for full",
    "budget_unit": "unit of budget: fraction or tokens; null for full",
    "allocator": "budget allocator across KV heads and layers: uniform, adakv, pyramidkv; "
                 "null for full",
    "alpha": "AdaKV allocator alpha; null unless allocator = adakv",
    "beta": "PyramidKV allocator beta; null unless allocator = pyramidkv",
    "schedule": "eviction schedule: oneshot or decode",
    "every": "decode steps between eviction events; null unless schedule = decode",
    "sinks": "first positions always kept (take-all)",
    "window": "last positions of the compressible range always kept (take-all)",
    "top_fraction": "fraction of the tail budget kept by score rank (take-all)",
    "mixture": "defensive mixture weight of the design; null if the design has none",
    "floor": "lower bound on inclusion probabilities; null if the design has none",
    "design_kind": "order-sampling kind of the fixed design (pareto, sequential); null "
                   "otherwise",
    "design_params": "JSON of the design's hyperparameters (its dataclass fields, sorted "
                     "keys; {} for a design without any, e.g. topk); null for full",
    "score_params": "JSON of the score-specific hyperparameters",
    "certified": "randomized design with Hajek correction: certificates and coverage apply",
    "summary_page": "positions per page of the summaries kept for the tokens a policy drops "
                    "(the deterministic bound); 0 = none",
    "deployable": "false for scores that read the evaluated queries themselves (oracle)",
    # bookkeeping
    "seed": "seed of the row (per-seed rows of randomized policies); null when aggregated "
            "over seeds or for a deterministic policy",
    "n_seeds": "seeds aggregated in the row (1 for deterministic policies)",
    "event": "eviction event the query falls after (0 = first event)",
    "context_tokens": "compressible tokens at the first event",
    "nominal_tokens": "nominal kept tokens of the budget at the first event",
    "budget_tokens": "kept-token budget of the KV head at the query's event (of the query "
                     "head's own sample with perstep gqa: head)",
    "truth_norm": "|o|, norm of the full-cache attention output (value units)",
    "output_check": "|o_stored - o_recomputed| / |o|: stored outputs vs float64 recomputation",
    # evict outcomes
    "answer": "decoded answer under eviction",
    "gold": "gold answer",
    "full_correct": "the full-cache run's verdict (from the store)",
    "failure": "cache_induced (full right, evicted wrong), inherent (both wrong), recovered "
               "(full wrong, evicted right), none (both right)",
    "same_tokens_as_full": "the evicted run generated exactly the full-cache tokens",
    "n_generated": "tokens generated under eviction",
    "logprob_mean": "mean log-probability of the generated tokens under eviction",
    "logprob_min": "smallest log-probability of a generated token",
    "logprob_first": "log-probability of the first generated token",
    "certificate_mean": "mean certificate C over decode steps, layers and heads; null "
                        "unless certified",
    "certificate_max": "largest certificate C over decode steps, layers and heads; null "
                       "unless certified",
    "layer_certificate_mean": "mean output-space certificate over steps and layers; null "
                              "unless computed",
    "layer_certificate_max": "largest output-space certificate; null unless computed",
    "certificate_by_layer": "mean certificate C per layer; null unless certified",
    "kept_tokens_mean": "mean kept prompt tokens per (layer, KV head)",
    "kept_fraction": "kept_tokens_mean / prompt_length",
    "memory_tokens": "kept prompt tokens summed over layers and KV heads",
    "full_memory_tokens": "prompt tokens summed over layers and KV heads (full cache)",
    "decode_seconds": "wall time of the decode (s)",
    # evict outcomes: per decode step costs (tracesim.capture.inloop.perstep.step_columns), means
    # over
    # the run's decode steps, summed over layers and KV heads unless noted
    "step_tokens_mean": "tokens of [0, t) a decode step attends, per (layer, KV head)",
    "step_tokens_fraction": "step_tokens_mean / t, mean over steps, layers and KV heads",
    "step_rows_read": "rows a per-step design reads from the lower tier per step "
                      "(attended tokens less sinks and window; 0 for resident kept sets)",
    "step_bytes": "bytes attention reads per step: attended tokens x token bytes, plus the "
                  "proxy's summary of the cached tokens for a per-step design",
    "step_link_bytes": "step_rows_read x token bytes: bytes over the link per step",
    "step_us": "modelled time of a step's lower-tier reads on the first lower tier of the "
               "tiers memory model (us; rows scattered, one transfer each, layer by layer)",
    # evict outcomes: the answer span (tracesim.capture.inloop.answer); null where the sequence has
    # no
    # located span (a task outside the generated ones, or the gold not found in the context)
    "answer_tokens": "prompt tokens carrying the gold answer's digits in the context, every "
                     "occurrence (the answer span)",
    "answer_kept_share": "share of the span tokens attended, mean over layers, KV heads and "
                         "decode steps (one-shot: the plan after prefill)",
    "answer_kept_min": "smallest per-(layer, KV head) share of span tokens attended (each a "
                       "mean over decode steps); 1 iff the whole span was kept everywhere",
    "answer_first_kept_share": "answer_kept_share of the tokens carrying each occurrence's "
                               "first digit",
    "answer_last_kept_share": "answer_kept_share of the tokens carrying each occurrence's "
                              "last digit",
    "answer_pi_mean": "mean inclusion probability of the span tokens over layers, KV heads "
                      "and decode steps; null unless the design is randomized",
    "answer_kept_by_head": "share of span tokens attended per (layer, KV head), layer-major "
                           "list of n_layers x n_kv_heads (means over decode steps)",
    "answer_pi_by_head": "mean inclusion probability of the span tokens per (layer, KV head), "
                         "layer-major list; null unless the design is randomized",
    # evict outcomes with in-loop fetches (tracesim evict --fetch); null without fetching
    "fetch_scheduler": "fetch scheduler enforced in the loop (none, random, certificate, "
                       "certificate_page, certificate_bound, bound, oracle); null without "
                       "fetching or for a "
                       "policy that evicts nothing",
    "fetch_budget": "byte budget per decode step and layer, fraction of the layer's evicted "
                    "bytes (1 = every evicted page); null without fetching",
    "fetch_page": "positions per fetched page (per KV head); null without fetching",
    "fetch_bytes": "bytes fetched, summed over decode steps, layers and KV heads; null "
                   "without fetching",
    "fetch_pages": "pages fetched, summed over decode steps, layers and KV heads; null "
                   "without fetching",
    "fetch_evicted_bytes": "bytes of every evicted page, summed over decode steps and layers "
                           "(what refetching everything would move); null without fetching",
    "fetch_bytes_share": "fetch_bytes / fetch_evicted_bytes; null without fetching",
    "fetch_ms": "modelled fetch time, summed over decode steps and layers (ms); null without "
                "fetching",
    "fetch_stall_ms": "modelled stall, summed over decode steps and layers (ms; the fetch time "
                      "less overlapped compute); null without fetching",
}

#: Metric columns of replay results: name -> description (means over seeds unless noted;
#: NaN in a description reads "null" in the columns' metadata). Their order is the columns'.
METRIC_DOCS: dict[str, str] = {
    "err2": "true squared error |o_hat - o|^2 (value units^2)",
    "err2_sd": "standard deviation of err2 over seeds (aggregated rows only)",
    "rel_err": "|o_hat - o| / |o|",
    "cert2": "primary certificate C^2 = tr V_hat (NaN unless certified)",
    "cert2_small": "m/(m-1) tr V_hat (inf for m <= 1 with a tail)",
    "tail_size": "realized tail size m: kept tail tokens (pi < 1) the query sees",
    "n_eff": "Kish effective sample size of the Hájek weights over the kept tail",
    "wald_cov": "fraction of coordinates inside the Wald interval z*sqrt(V_jj)",
    "wald_t_cov": "same with t_{m-1} and m/(m-1) inflation (small sample)",
    "sat_cov": "fraction of seeds with |e|^2 inside the Satterthwaite bound (needs "
               "satterthwaite=True, else NaN)",
    "sat_t_cov": "same with m/(m-1) inflation",
    "kept_tokens": "realized kept tokens of the KV head at the query's event (of the query "
                   "head's own sample with perstep gqa: head; the KV head's group then reads "
                   "the sum of its heads' rows)",
    "expected_kept": "sum of pi at the query's event (expected memory; per query head with "
                     "perstep gqa: head)",
    "tail_population": "tokens with pi < 1 the query would see (kept or not)",
    "tail_out_mass": "full-cache attention mass on sampled-out tokens (pi > 0)",
    "tail_out_max": "largest full-cache weight of a sampled-out token",
    "evicted_mass": "full-cache attention mass on evicted tokens (pi = 0)",
    "evicted_max": "largest full-cache weight of an evicted token",
    "max_tail_weight": "largest normalised Hájek weight a_i of a kept tail "
                       "token (pi < 1); server-knowable (NaN: no kept tail "
                       "token the query sees, or not certified)",
    "layer_err2": "|sum_h W_O,h (o_hat_h - o_h)|^2 of the layer (output space; NaN "
                  "without o_proj); repeated on every head row",
    "layer_cert2": "output-space (GQA) certificate of the layer; repeated per head",
    "bound2": "page-summary bound squared, >= err2 for every draw (value units^2; NaN "
              "unless summary_page > 0)",
    "bound_cov": "fraction of seeds with err2 <= bound2 (must be 1; NaN without "
                 "summaries)",
    "bound_mass": "bound on the full-cache attention mass of the missing tokens",
    "summary_tokens": "memory of the page summaries, token-equivalents per KV head",
}

#: Columns of replay results written only with the Poisson bootstrap on
#: (``ReplayOptions.bootstrap = B > 0``), after the metrics.
BOOTSTRAP_DOCS: dict[str, str] = {
    "boot_cov": "fraction of coordinates inside the Poisson-bootstrap interval "
                "z*sqrt(V_boot,jj) (NaN where wald_cov is)",
    "boot_cert2": "Poisson-bootstrap variance trace tr V_boot over B replicates, in the units "
                  "of cert2 (NaN unless certified)",
}


def description(name: str) -> str:
    """Description of column ``name`` (:data:`COLUMN_DOCS`, else :data:`METRIC_DOCS`)."""
    if name in COLUMN_DOCS:
        return COLUMN_DOCS[name]
    if name in METRIC_DOCS:
        return METRIC_DOCS[name].replace("NaN", "null")
    if name in BOOTSTRAP_DOCS:
        return BOOTSTRAP_DOCS[name].replace("NaN", "null")
    return ""


def describe_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` with every field's ``description`` metadata set (kept if already there)."""
    out = []
    for f in schema:
        meta = dict(f.metadata or {})
        if DESCRIPTION_KEY not in meta:
            meta[DESCRIPTION_KEY] = description(f.name).encode()
        out.append(f.with_metadata(meta))
    return pa.schema(out, metadata=schema.metadata)


def describe_table(table: pa.Table) -> pa.Table:
    """``table`` with descriptions on its fields."""
    return table.cast(describe_schema(table.schema))


def to_arrow(name: str, values: Any, typ: pa.DataType | None = None) -> pa.Array:
    """An Arrow array of column ``name`` with "not applicable" values as nulls.

    NaN in a float column, the :data:`INT_SENTINELS` value, an empty string and an empty list
    become null.
    """
    if isinstance(values, np.ndarray) and values.dtype != object:
        mask = None
        if values.dtype.kind == "f":
            mask = np.isnan(values)
        elif values.dtype.kind in "iu" and name in INT_SENTINELS:
            mask = values == INT_SENTINELS[name]
        if mask is not None and not mask.any():
            mask = None
        direct = _from_buffers(values, typ, mask)
        return direct if direct is not None else pa.array(values, type=typ, mask=mask)
    if isinstance(values, np.ndarray) and typ is not None and pa.types.is_string(typ):
        direct = _strings_from_buffers(name, values)
        if direct is not None:
            return direct
    items = list(values)
    if typ is None:
        try:
            typ = pa.array(items).type
        except (pa.ArrowException, ValueError, TypeError):
            typ = None
        if typ is not None and (pa.types.is_null(typ) or (
                pa.types.is_list(typ) and pa.types.is_null(typ.value_type))):
            typ = pa.list_(pa.float64()) if pa.types.is_list(typ) else None
    clean = [None if _missing(name, v) else v for v in items]
    return pa.array(clean, type=typ)


# Arrow arrays built straight from numpy buffers. ``pa.array`` imports pandas on its first call
# (about a quarter of a second), which a one-layer replay from the command line would pay for
# nothing; numeric and string columns of known type do not need it.
_NUMERIC = {pa.float64(): np.float64, pa.float32(): np.float32, pa.int64(): np.int64,
            pa.int32(): np.int32, pa.int16(): np.int16, pa.int8(): np.int8,
            pa.uint64(): np.uint64, pa.uint32(): np.uint32, pa.uint8(): np.uint8}


def _validity(mask: np.ndarray | None) -> tuple[pa.Buffer | None, int]:
    if mask is None:
        return None, 0
    return pa.py_buffer(np.packbits(~mask, bitorder="little")), int(mask.sum())


def _from_buffers(values: np.ndarray, typ: pa.DataType | None,
                  mask: np.ndarray | None) -> pa.Array | None:
    """A numeric or boolean Arrow array over ``values``; None where ``pa.array`` must do it."""
    if values.ndim != 1:
        return None
    if typ is not None and pa.types.is_boolean(typ) or typ is None and values.dtype == bool:
        if values.dtype != bool:
            return None
        data = pa.py_buffer(np.packbits(values, bitorder="little"))
        typ = pa.bool_()
    else:
        np_type = _NUMERIC.get(typ) if typ is not None else None
        if np_type is None or values.dtype.kind not in "iuf" or (
                values.dtype.kind == "f" and np.dtype(np_type).kind != "f"):
            return None
        if np.dtype(np_type).kind in "iu" and values.size:
            info = np.iinfo(np_type)  # out of range: pa.array raises, as it should
            if values.min() < info.min or values.max() > info.max:
                return None
        data = pa.py_buffer(np.ascontiguousarray(values, dtype=np_type))
    validity, nulls = _validity(mask)
    return pa.Array.from_buffers(typ, values.size, [validity, data], null_count=nulls)


def _strings_from_buffers(name: str, values: np.ndarray) -> pa.Array | None:
    """A string Arrow array over an object array of str (empty and None per the null rule).

    Result columns hold long runs of one value (a configuration's strings repeat over its
    rows), so each run is encoded once.
    """
    n = values.size
    if values.ndim != 1:
        return None
    starts = np.flatnonzero(np.r_[True, values[1:] != values[:-1]]) if n else \
        np.zeros(0, dtype=np.int64)
    run_values = values[starts]
    if not all(v is None or isinstance(v, str) for v in run_values):
        return None
    return strings_from_runs(name, list(run_values), np.diff(np.r_[starts, n]))


def strings_from_runs(name: str, run_values: list[str | None],
                      lengths: np.ndarray) -> pa.Array | None:
    """A string Arrow array of ``lengths[i]`` copies of ``run_values[i]`` in turn (empty and
    None per the null rule), each run encoded once; None when the offsets overflow int32."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = int(lengths.sum())
    missing = np.array([_missing(name, v) for v in run_values], dtype=bool)
    encoded = [b"" if m else v.encode() for v, m in zip(run_values, missing, strict=True)]
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.repeat(np.array([len(b) for b in encoded], dtype=np.int64), lengths),
              out=offsets[1:])
    if offsets[-1] >= 2**31:
        return None
    mask = np.repeat(missing, lengths)
    validity, nulls = _validity(mask if mask.any() else None)
    data = b"".join(b * int(k) for b, k in zip(encoded, lengths, strict=True))
    return pa.Array.from_buffers(pa.string(), n, [validity, pa.py_buffer(offsets.astype(np.int32)),
                                                  pa.py_buffer(data)], null_count=nulls)


def _missing(name: str, v: Any) -> bool:
    if v is None:
        return True
    if isinstance(v, float):
        return v != v
    if isinstance(v, str):
        return v == "" and name in EMPTY_STRING_NULL
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return INT_SENTINELS.get(name) == int(v)
    if isinstance(v, (list, tuple, np.ndarray)):
        return len(v) == 0
    return False


def nullify_rows(rows: list[Mapping[str, Any]]) -> pa.Table:
    """A described table from row dicts, with not-applicable values as nulls."""
    names: list[str] = []
    for r in rows:
        names += [k for k in r if k not in names]
    cols = {n: to_arrow(n, [r.get(n) for r in rows]) for n in names}
    return describe_table(pa.table(cols)) if cols else pa.table({})
