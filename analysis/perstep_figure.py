"""The per-step frontier: error and coverage against HBM memory and against bytes per step.

One point per configuration of :func:`tracesim.analysis.perstep.perstep_table` with the costs of
:func:`tracesim.analysis.perstep_costs.cost_columns`, per layer and decode step, summed over the
layer's
KV heads:

- **HBM** (``hbm_kib``): what stays in fast memory between steps (a prefill design's kept set; a
  per-step design's sinks, window and proxy summary of every cached token).
- **Bytes per step** (``step_read_kib``): what attention reads at one step wherever it lives,
  the proxy's summary of every cached token included (:mod:`tracesim.analysis.perstep_costs`).

The top panels plot the mean squared error (log scale), the bottom ones Wald coverage of all
rows, with the nominal level as a line; uncertified configurations (top-k) have no coverage
and appear in the top panels only.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from tracesim.analysis.aggregate import ResultsDataset
from tracesim.analysis.plotting import png_bytes, pyplot

__all__ = ["add_to_report", "frontier_figure"]


def _label(row: pd.Series) -> str:
    if row["score"] == "perstep":
        sched = "" if row["schedule"] in ("step(fresh)", "—") else f" {row['schedule']}"
        return f"{row['proxy']}/{row['design']}{sched}"
    return f"{row['score']}/{row['design']}"


def frontier_figure(table: pd.DataFrame, nominal: float = 0.95) -> tuple[bytes, str] | None:
    """Error and coverage against HBM and bytes per step (module docstring); ``table`` needs
    the columns of ``perstep_table`` plus ``hbm_kib`` and ``step_read_kib``. ``None`` when no
    configuration has finite costs."""
    t = table[np.isfinite(table["hbm_kib"]) & np.isfinite(table["step_read_kib"])
              & (table["mse"] > 0)]
    if t.empty:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex="col")
    markers = {"perstep": "o", "snapkv": "D"}  # any other prefill score: squares
    colours = {score: f"C{i}" for i, score in enumerate(dict.fromkeys(t["score"]))}
    for col, (x, xlabel) in enumerate((("hbm_kib", "HBM per layer (KiB)"),
                                       ("step_read_kib", "bytes read per layer and step (KiB)"))):
        for row, y in enumerate(("mse", "wald")):
            ax = axes[row, col]
            for (score, topk), h in t[np.isfinite(t[y])].groupby(
                    ["score", t["design"] == "topk"], sort=False):
                ax.scatter(h[x], h[y], marker=markers.get(score, "s"), alpha=0.85,
                           facecolors="none" if topk else colours[score],
                           edgecolors=colours[score],
                           label=f"{score} {'top-k' if topk else 'randomized'}")
                for _, r in h.iterrows():
                    ax.annotate(_label(r), (r[x], r[y]), fontsize=6, xytext=(3, 2),
                                textcoords="offset points")
            ax.set_xscale("log")
            if y == "mse":
                ax.set_yscale("log")
                ax.set_ylabel("mean squared error")
            else:
                ax.axhline(nominal, color="grey", lw=0.8, ls="--")
                ax.set_ylabel("Wald coverage (all rows)")
            if row == 1:
                ax.set_xlabel(xlabel)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    seen = dict(zip(labels, handles, strict=True))
    axes[0, 0].legend(seen.values(), seen.keys(), fontsize=7)
    caption = ("Per-step and prefill designs: mean squared error (top) and Wald coverage of all "
               "rows (bottom) against the HBM each holds per layer (left) and the bytes "
               "attention reads per layer and decode step, the proxy's summary included "
               "(right); open markers are top-k (no coverage). Costs: the tiers memory model's "
               "defaults (docs/perstep.md, Costs).")
    return png_bytes(fig), caption


def add_to_report(report, results: pd.DataFrame | ResultsDataset, head_dim: int = 64, *,
                  title: str = "per-step designs", figure: str = "perstep_frontier",
                  label: str = "") -> None:
    """The report's per-step table (:func:`tracesim.analysis.perstep.perstep_table` with the
    costs of :func:`tracesim.analysis.perstep_costs.cost_columns`; one part per store when the
    results hold several, as a length sweep does) and :func:`frontier_figure`, under ``title``
    and ``figure``; ``label`` (e.g. the input's directory and sweep) opens the caption.

    Computed from per-configuration sums (:mod:`tracesim.analysis.perstep_stream`), never from
    the rows: the memory is that of one row per configuration and sequence, whatever the rows.
    """
    from tracesim.analysis.perstep_stream import perstep_costs_table, pooled_and_by_tables

    ds = results if isinstance(results, ResultsDataset) else ResultsDataset.from_frame(results)
    stores = (int(ds.query("SELECT count(DISTINCT \"store\") AS n FROM results")["n"].iloc[0])
              if "store" in ds else 0)
    # Stores of different lengths (a length sweep) are tabulated apart; the figure pools them.
    if stores > 1:
        table, shown = pooled_and_by_tables(ds, "store", head_dim)
    else:
        table = shown = perstep_costs_table(ds, head_dim)
    report.tables[title] = shown.to_string(index=False, float_format=lambda x: f"{x:.4g}")
    made = frontier_figure(table)
    if made is not None and stores > 1:
        made = (made[0], made[1] + f" Pooled over {stores} stores; the table lists each store "
                "apart.")
    if made is not None and label:
        made = (made[0], f"{label}: {made[1]}")
    report.add_figure(figure, made)
