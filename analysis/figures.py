"""Report figures (matplotlib, Agg backend), each returned as PNG bytes."""

from __future__ import annotations

import numpy as np
import pandas as pd
from tracesim.analysis.plotting import png_bytes, pyplot
from tracesim.analysis.report_figures import policy_labels

__all__ = ["coverage_figure", "error_budget_figure", "head_budget_figure",
           "recompute_figure", "roc_figure"]


def coverage_figure(strata: dict, nominal: float) -> bytes:
    """Empirical coverage with cluster-robust intervals per stratum, against nominal."""
    plt = pyplot()
    fig, axes = plt.subplots(1, max(1, len(strata)), figsize=(4.2 * max(1, len(strata)), 3.4),
                             squeeze=False)
    for ax, (title, res) in zip(axes[0], strata.items(), strict=False):
        x = np.arange(len(res.strata))
        ax.errorbar(x, res.coverage, yerr=[res.coverage - res.ci_low, res.ci_high - res.coverage],
                    fmt="o", capsize=3)
        ax.axhline(nominal, color="k", ls="--", lw=1, label=f"nominal {nominal:g}")
        ax.set_xticks(x, res.strata, rotation=30, ha="right", fontsize=8)
        ax.set_ylim(max(0.0, min(0.5, float(np.nanmin(res.ci_low)) - 0.05)), 1.01)
        ax.set_title(f"coverage by {title}", fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
    return png_bytes(fig)


def _dataset(results):
    from tracesim.analysis.aggregate import ResultsDataset

    return ResultsDataset.from_frame(results) if isinstance(results, pd.DataFrame) else results


def error_budget_figure(results) -> bytes:
    """Mean relative attention error vs budget, one line per (score, design).

    Drawn from sums of ``rel_err`` per (score, design, budget, and the columns the labels
    read), not from the rows (``results``: a DataFrame or a
    :class:`~tracesim.analysis.aggregate.ResultsDataset`)."""

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ds = _dataset(results)
    keys = [c for c in ("score", "design", "budget", "mixture", "top_fraction", "allocator")
            if c in ds]
    sums = ds.query(
        "SELECT " + ", ".join(f'"{k}"' for k in keys) + ', count(CASE WHEN NOT isnan("rel_err") '
        'THEN 1 END) AS n, sum(CASE WHEN NOT isnan("rel_err") THEN "rel_err" END) AS s, '
        'min(__row) AS first_row FROM results WHERE "budget_unit" = \'fraction\' GROUP BY '
        + ", ".join(f'"{k}"' for k in keys) + " ORDER BY first_row") if not ds.empty else \
        pd.DataFrame(columns=[*keys, "n", "s", "first_row"])
    # Designs that ignore the score give identical rows for every score: one line, one label
    # (the score of the label's first row in the table, as before).
    sums["label"] = policy_labels(sums)
    for label, g in sums.groupby("label"):
        first = g["score"].iloc[0]
        g = g[g["score"] == first].groupby("budget")[["s", "n"]].sum()
        m = (g["s"] / g["n"]).where(g["n"] > 0)
        ax.plot(m.index, m.values, marker="o", label=label)
    ax.set_xlabel("budget (fraction of context)")
    ax.set_ylabel("mean relative error |ô - o| / |o|")
    ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("attention error vs budget")
    return png_bytes(fig)


def roc_figure(curves: dict[str, tuple[np.ndarray, np.ndarray]]) -> bytes:
    """ROC curves of the failure / attribution signals."""
    from sklearn.metrics import roc_auc_score, roc_curve

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.6, 4.2))
    for name, (score, label) in curves.items():
        if label.all() or not label.any():
            continue
        fpr, tpr, _ = roc_curve(label, score)
        ax.plot(fpr, tpr, label=f"{name} (AUC {roc_auc_score(label, score):.2f})")
    ax.plot([0, 1], [0, 1], "k--", lw=1)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("ROC")
    return png_bytes(fig)


def head_budget_figure(results) -> bytes:
    """Mean kept tokens per (layer, KV head) for each allocator of the certified policies,
    from sums per (allocator, layer, KV head)."""
    plt = pyplot()
    ds = _dataset(results)
    sums = ds.sums(["allocator", "layer", "kv_head"], ["kept_tokens"],
                   "\"score\" IS DISTINCT FROM 'full'") if not ds.empty else pd.DataFrame(
        columns=["allocator", "layer", "kv_head", "n_kept_tokens", "sum_kept_tokens"])
    sums["mean"] = (sums["sum_kept_tokens"] / sums["n_kept_tokens"]).where(
        sums["n_kept_tokens"] > 0)
    allocs = sorted(sums["allocator"].dropna().unique()) or ["uniform"]
    fig, axes = plt.subplots(1, len(allocs), figsize=(4.2 * len(allocs), 3.6), squeeze=False)
    pivs = {a: sums[sums["allocator"] == a].pivot_table(index="layer", columns="kv_head",
                                                        values="mean", aggfunc="first")
            for a in allocs}
    # One scale for every panel, from 0: a uniform allocation reads as one flat colour instead
    # of a per-panel stretch of rounding noise.
    vmax = max([float(np.nanmax(p.values)) for p in pivs.values() if p.size] or [1.0])
    for ax, alloc in zip(axes[0], allocs, strict=False):
        piv = pivs[alloc]
        im = ax.imshow(piv.values, aspect="auto", cmap="viridis", vmin=0, vmax=vmax)
        ax.set_xticks(range(piv.shape[1]), [str(c) for c in piv.columns])
        ax.set_xlabel("KV head")
        ax.set_ylabel("layer")
        ax.set_title(f"kept tokens ({alloc})", fontsize=10)
        fig.colorbar(im, ax=ax)
    return png_bytes(fig)


def recompute_figure(curves: pd.DataFrame) -> bytes:
    """Recovered share of squared error vs recompute budget, per gate."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.8))
    for gate, g in curves.groupby("gate"):
        m = g.groupby("budget")["recovered"].mean()
        ax.plot(m.index, m.values, marker="o", label=gate)
    ax.set_xlabel("recompute budget (share of decode-step x head units)")
    ax.set_ylabel("share of squared error recovered")
    ax.legend(fontsize=8)
    ax.set_title("recomputation scheduling")
    return png_bytes(fig)
