"""Replay results as Arrow record batches: one row per (sequence, layer, head, query, policy).

By default rows aggregate the seeds (means, plus ``n_seeds``); ``per_seed=True`` gives one row
per seed instead. Every row carries its full configuration (:data:`POLICY_COLUMNS`).
Deterministic policies are replayed once (``n_seeds = 1``; per-seed rows have ``seed = -1``).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from tracesim.coverage import satterthwaite_quantile
from tracesim.kernels import bounds as KB
from tracesim.kernels import replay as K
from tracesim.policies import POLICY_COLUMNS
from tracesim.replay.engine import LayerResult

__all__ = ["METRICS", "RESULT_COLUMNS", "layer_batch"]

#: Metric columns: name -> (kernel field or None, description). Means over seeds unless noted.
METRICS: dict[str, tuple[int | None, str]] = {
    "err2": (K.F_ERR2, "true squared error |o_hat - o|^2 (value units^2)"),
    "err2_sd": (None, "standard deviation of err2 over seeds (aggregated rows only)"),
    "rel_err": (K.F_REL, "|o_hat - o| / |o|"),
    "cert2": (K.F_CERT2, "primary certificate C^2 = tr V_hat (NaN unless certified)"),
    "cert2_small": (K.F_CERT2_SMALL, "m/(m-1) tr V_hat (inf for m <= 1 with a tail)"),
    "tail_size": (K.F_TAIL, "realized tail size m: kept tail tokens (pi < 1) the query sees"),
    "n_eff": (K.F_NEFF, "Kish effective sample size of the Hájek weights over the kept tail"),
    "wald_cov": (K.F_WALD, "fraction of coordinates inside the Wald interval z*sqrt(V_jj)"),
    "wald_t_cov": (K.F_WALD_T, "same with t_{m-1} and m/(m-1) inflation (small sample)"),
    "sat_cov": (None, "fraction of seeds with |e|^2 inside the Satterthwaite bound (needs "
                      "satterthwaite=True, else NaN)"),
    "sat_t_cov": (None, "same with m/(m-1) inflation"),
    "kept_tokens": (K.F_KEPT, "realized kept tokens of the KV head at the query's event"),
    "expected_kept": (K.F_EXPECTED, "sum of pi at the query's event (expected memory)"),
    "tail_population": (K.F_POP, "tokens with pi < 1 the query would see (kept or not)"),
    "tail_out_mass": (K.F_OUT_MASS, "full-cache attention mass on sampled-out tokens (pi > 0)"),
    "tail_out_max": (K.F_OUT_MAX, "largest full-cache weight of a sampled-out token"),
    "evicted_mass": (K.F_EV_MASS, "full-cache attention mass on evicted tokens (pi = 0)"),
    "evicted_max": (K.F_EV_MAX, "largest full-cache weight of an evicted token"),
    "max_tail_weight": (K.F_MAX_TAIL, "largest normalised Hájek weight a_i of a kept tail "
                                      "token (pi < 1); server-knowable (NaN: no kept tail "
                                      "token the query sees, or not certified)"),
    "layer_err2": (None, "|sum_h W_O,h (o_hat_h - o_h)|^2 of the layer (output space; NaN "
                         "without o_proj); repeated on every head row"),
    "layer_cert2": (None, "output-space (GQA) certificate of the layer; repeated per head"),
    "bound2": (None, "page-summary bound squared, >= err2 for every draw (value units^2; NaN "
                     "unless summary_page > 0)"),
    "bound_cov": (None, "fraction of seeds with err2 <= bound2 (must be 1; NaN without "
                        "summaries)"),
    "bound_mass": (None, "bound on the full-cache attention mass of the missing tokens"),
    "summary_tokens": (None, "memory of the page summaries, token-equivalents per KV head"),
}

#: Every column in order, with its Arrow type.
RESULT_COLUMNS: dict[str, pa.DataType] = {
    "sequence_id": pa.string(), "task": pa.string(), "correct": pa.bool_(),
    "layer": pa.int32(), "head": pa.int32(), "kv_head": pa.int32(),
    "query_index": pa.int32(), "query_position": pa.int32(), "query_role": pa.string(),
    "prompt_length": pa.int32(), "n_positions": pa.int32(),
    **{c: (pa.string() if c in ("config_id", "score", "design", "correction", "budget_unit",
                                  "allocator", "schedule", "design_kind", "score_params")
           else pa.bool_() if c in ("certified", "deployable")
           else pa.int32() if c in ("every", "sinks", "window", "summary_page")
           else pa.float64())
       for c in POLICY_COLUMNS},
    "seed": pa.int64(), "n_seeds": pa.int32(), "event": pa.int32(),
    "context_tokens": pa.int32(), "nominal_tokens": pa.int32(), "budget_tokens": pa.float64(),
    "truth_norm": pa.float64(), "output_check": pa.float64(),
    **{name: pa.float64() for name in METRICS},
}


def _satterthwaite(out: np.ndarray, lerr: np.ndarray, alpha: float) -> tuple[np.ndarray, ...]:
    """Per-seed Satterthwaite coverage (NaN where tr V^2 was not computed)."""
    tr, tr2, err2 = out[..., K.F_CERT2], out[..., K.F_TRV2], out[..., K.F_ERR2]
    m, pop = out[..., K.F_TAIL], out[..., K.F_POP]
    ok = np.isfinite(tr2) & (pop > 0)
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


def layer_batch(result: LayerResult, per_seed: bool = False) -> pa.RecordBatch:
    """Arrow rows of one replayed layer (see :data:`RESULT_COLUMNS`)."""
    tr = result.trace
    tabs = result.tables
    H, NQ = tr.n_heads, result.query_positions.size
    G = tr.group_size
    out, lout = result.out, result.lout
    sat, sat_t = _satterthwaite(out, lout, result.options.alpha)
    # Nominal budget of each (iteration, head, query) from its event and KV head.
    ev_global = tabs.slot_ev[tabs.it_slot][:, None, None] + out[..., K.F_EVENT].astype(np.int64)
    kv_of_head = np.arange(H) // G
    budget = tabs.budget_tokens[ev_global, kv_of_head[None, :, None]].astype(np.float64)
    per_it = {name: out[..., f] for name, (f, _) in METRICS.items() if f is not None}
    per_it.update(sat_cov=sat, sat_t_cov=sat_t, budget_tokens=budget,
                  layer_err2=np.broadcast_to(lout[:, None, :, K.L_ERR2], out.shape[:3]),
                  layer_cert2=np.broadcast_to(lout[:, None, :, K.L_CERT2], out.shape[:3]))
    per_it.update(_bound_metrics(result))
    if per_seed:
        groups = [np.array([i]) for i in range(tabs.it_cfg.size)]
    else:
        bounds = np.flatnonzero(np.diff(tabs.it_cfg)) + 1
        groups = np.split(np.arange(tabs.it_cfg.size), bounds)
    cols: dict[str, list[np.ndarray]] = {name: [] for name in RESULT_COLUMNS}
    n_rows = H * NQ
    head = np.repeat(np.arange(H), NQ)
    qi = np.tile(np.arange(NQ), H)
    rows = [p.row() for p in result.policies]
    for its in groups:
        c = int(tabs.it_cfg[its[0]])
        for name, values in per_it.items():
            block = values[its]
            agg = block[0] if per_seed else block.mean(axis=0)
            cols[name].append(agg.reshape(-1))
        cols["err2_sd"].append(np.full(n_rows, np.nan) if per_seed or its.size < 2
                               else per_it["err2"][its].std(axis=0, ddof=1).reshape(-1))
        cols["event"].append(out[its[0], ..., K.F_EVENT].reshape(-1).astype(np.int64))
        policy = result.policies[c]
        seed = int(result.seeds[tabs.it_seed[its[0]]]) if policy.needs_seeds else -1
        cols["seed"].append(np.full(n_rows, seed if per_seed else -1))
        cols["n_seeds"].append(np.full(n_rows, its.size))
        cols["context_tokens"].append(np.full(n_rows, tabs.context[c]))
        cols["nominal_tokens"].append(np.full(n_rows, tabs.nominal[c]))
        for key, value in rows[c].items():
            cols[key].append(np.full(n_rows, value, dtype=object if isinstance(value, str)
                                     else None))
        cols["head"].append(head)
        cols["kv_head"].append(head // G)
        cols["query_index"].append(result.query_index[qi])
        cols["query_position"].append(result.query_positions[qi])
        cols["query_role"].append(np.asarray(result.query_roles, dtype=object)[qi])
        cols["truth_norm"].append(result.truth_norm.reshape(-1))
        cols["output_check"].append(result.output_check.reshape(-1))
    n_total = sum(a.size for a in cols["head"])
    meta = tr.meta
    const = {"sequence_id": tr.sequence_id, "task": str(meta.get("task", "")),
             "correct": bool(meta.get("correct", False)), "layer": tr.layer,
             "prompt_length": tr.prompt_length, "n_positions": tr.n_positions}
    arrays = []
    for name, typ in RESULT_COLUMNS.items():
        if name in const:
            arrays.append(pa.array(np.full(n_total, const[name],
                                           dtype=object if isinstance(const[name], str)
                                           else None), type=typ))
        else:
            arrays.append(pa.array(np.concatenate(cols[name]), type=typ))
    return pa.RecordBatch.from_arrays(arrays, names=list(RESULT_COLUMNS))
