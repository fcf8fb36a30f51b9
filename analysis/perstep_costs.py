"""Memory and transfer costs of per-step and prefill designs, through the tiers memory model.

Per layer and decode step, summed over the layer's KV heads, with ``b`` the bytes of one token
of one KV head (its key and value, ``2 d`` elements of ``bytes_per_element``):

- **HBM bytes** (resident between steps). A prefill design keeps its kept set: ``kept x b``.
  A per-step design keeps the sinks and the window, which every step attends, plus the
  proxy's summary of every cached token: ``(sinks + window) x b + P x proxy_bits / 8``; every
  other token lives in the lower tier.
- **Rows read per step.** A per-step design reads its proxy top-h and its sample from the
  lower tier: ``kept - sinks - window`` tokens. ``kept`` is the ``kept_tokens`` column, which
  counts the kept tokens of the step's cache ``[0, t)`` only, so the current token (always
  kept, and in HBM) is already out of it. A prefill design reads none. With ``gqa: head``
  every query head reads its own sample, so a KV head reads the sum over its ``G`` query
  heads, ``G (kept - sinks - window)`` with ``kept`` the mean per query head (rows two heads
  both sampled are counted twice: a gather that reads their union reads fewer).
- **Bytes attention reads per step** (``step_read_kib``), wherever they live: the attended
  tokens' keys and values (``kept x b``, ``G`` times for ``gqa: head``), plus, for a per-step
  design, the proxy's summary of every cached token, which it scores before it samples
  (``P x proxy_bits / 8``). This is what ``tracesim evict`` reports as ``step_bytes``.
- **Bytes over the link.** Either those rows (``rows x b``), or, when attention over the
  sample runs where the rows live (as MagicPIG runs it on the CPU), only partial sums per
  query head: the Hájek numerator (``d``), denominator (1) and certificate sums (``d + 2``)
  in float32, ``G (2 d + 3) x 4`` bytes per KV head, merged with the HBM part by
  log-sum-exp rescaling.
- **Modelled step time** of those transfers on the first lower tier of
  :class:`tracesim.tiers.model.MemoryModel` (default: host DRAM over PCIe 5, 64 GB/s, 10 µs per
  transfer, queue depth 8): rows are scattered, one transfer each; partial sums are one
  transfer per KV head. The time of computing attention where the rows live is not modelled.
"""

from __future__ import annotations

import json

import pandas as pd

__all__ = ["config_costs", "cost_columns"]


def cost_columns(table: pd.DataFrame, df: pd.DataFrame, head_dim: int = 64,
                 model=None) -> pd.DataFrame:
    """``table`` (:func:`tracesim.analysis.perstep.perstep_table`) with the cost columns added:
    ``hbm_kib``, ``read_rows``, ``link_kib`` (rows), ``link_kib_partial``, ``step_us`` (rows),
    ``step_us_partial`` and ``step_read_kib``, per layer and decode step (module docstring)."""
    n_kv = int(df["kv_head"].nunique())
    G = int(df["head"].nunique()) // max(n_kv, 1)
    first = df.drop_duplicates("config_id").set_index("config_id")
    out = []
    for cid, g in df.groupby("config_id", sort=False):
        P = float(g["n_positions"].mean()) if "n_positions" in g else float("nan")
        out.append(config_costs(first.loc[cid], float(g["kept_tokens"].mean()), P, n_kv, G,
                                head_dim, model))
    return pd.concat([table.reset_index(drop=True), pd.DataFrame(out)], axis=1)


def config_costs(meta: pd.Series, kept: float, P: float, n_kv: int, G: int,
                 head_dim: int = 64, model=None) -> dict[str, float]:
    """One configuration's cost columns (:func:`cost_columns`) from its first row ``meta``
    (score, score parameters, sinks, window), its mean kept tokens ``kept``, mean cached
    positions ``P``, and the results' KV heads ``n_kv`` and query heads per KV head ``G``."""
    from tracesim.proxies import make_proxy
    from tracesim.tiers.model import MemoryModel

    model = model or MemoryModel()
    tier = model.lower[0]
    b = model.token_bytes(head_dim)
    per_step = meta["score"] == "perstep"
    resident = int(meta["sinks"]) + int(meta["window"])
    if per_step:
        params = json.loads(meta["score_params"])
        summary = P * make_proxy(params.get("proxy", "exact")).bits_per_token(head_dim) / 8
        hbm = resident * b + summary
        # kept_tokens stops before the step's own token: nothing more to subtract.
        rows = max(0.0, kept - resident)
        # each query head reads its own sample with gqa: head (kept is per query head)
        samples = G if params.get("gqa") == "head" else 1
        rows *= samples
        read = kept * b * samples + summary  # the step scores every token's summary
    else:
        hbm, rows, read = kept * b, 0.0, kept * b
    partial = G * (2 * head_dim + 3) * 4 if per_step else 0.0
    t_rows = float(tier.fetch_seconds(rows * n_kv, rows * n_kv * b)) if rows else 0.0
    t_part = float(tier.fetch_seconds(n_kv, partial * n_kv)) if per_step else 0.0
    return {"hbm_kib": hbm * n_kv / 1024, "read_rows": rows * n_kv,
            "link_kib": rows * n_kv * b / 1024, "link_kib_partial": partial * n_kv / 1024,
            "step_us": t_rows * 1e6, "step_us_partial": t_part * 1e6,
            "step_read_kib": read * n_kv / 1024}
