"""End-to-end outcomes of in-loop fetches (``tracesim evict --fetch``): accuracy against bytes.

``tracesim evict --fetch`` runs every evicting policy and seed once per (fetch scheduler, fetch
budget); each outcome row carries ``fetch_scheduler``, ``fetch_budget`` and its byte and stall
totals (null for runs without fetching and for policies that evict nothing).

* :func:`split_fetch_outcomes` — the rows the outcome claims read (no fetching, or the ``none``
  scheduler, which is plain eviction) and the fetch rows.
* :func:`fetch_table` — per policy, scheduler and budget: accuracy, runs that kept the
  full-cache tokens, bytes moved as a share of refetching every evicted page, MB moved and
  modelled stall per decode step.
* :func:`compare_fetch` — paired one-sided tests over sequences (correct answers summed over
  seeds) of one scheduler against others at equal budgets, Holm-adjusted.
* :func:`fetch_figure` — accuracy against bytes moved, one line per scheduler.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from tracesim.analysis.multiplicity import holm
from tracesim.analysis.plotting import png_bytes, pyplot
from tracesim.analysis.tiers import _one_sided_p

__all__ = ["POLICY_KEYS", "compare_fetch", "fetch_figure", "fetch_table",
           "split_fetch_outcomes"]

#: Columns that identify the base policy of an outcome row.
POLICY_KEYS = ["score", "design", "correction", "budget"]


def split_fetch_outcomes(outcomes: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(plain, fetch)``: rows without fetching (``fetch_scheduler`` null or ``none``) and the
    rows of every fetch scheduler (``none`` included, as the zero-byte reference)."""
    if "fetch_scheduler" not in outcomes or outcomes["fetch_scheduler"].isna().all():
        return outcomes, outcomes.iloc[:0]
    sched = outcomes["fetch_scheduler"]
    plain = outcomes[sched.isna() | (sched == "none")]
    return plain, outcomes[sched.notna()]


def fetch_table(fetch: pd.DataFrame) -> pd.DataFrame:
    """Accuracy and bytes per (policy, scheduler, budget); sums over runs for the byte ratios.

    Columns: ``runs``, ``accuracy``, ``full_tokens`` (share of runs that generated exactly the
    full-cache tokens), ``bytes_share`` (sum of ``fetch_bytes`` over sum of
    ``fetch_evicted_bytes``), ``mb_per_step`` and ``stall_ms_per_step`` (sums over the runs'
    decode steps after the first, summed over layers).
    """
    keys = POLICY_KEYS + ["fetch_scheduler", "fetch_budget"]
    f = fetch.assign(steps=(fetch["n_generated"] - 1).clip(lower=1),
                     correct=fetch["correct"].astype(float),
                     same=fetch["same_tokens_as_full"].astype(float))
    g = f.groupby(keys, dropna=False)
    sums = g[["fetch_bytes", "fetch_evicted_bytes", "fetch_stall_ms", "steps"]].sum()
    out = pd.DataFrame({"runs": g.size(), "accuracy": g["correct"].mean(),
                        "full_tokens": g["same"].mean()})
    evicted = sums["fetch_evicted_bytes"].where(sums["fetch_evicted_bytes"] > 0)
    out["bytes_share"] = sums["fetch_bytes"] / evicted
    out["mb_per_step"] = sums["fetch_bytes"] / sums["steps"] / 1e6
    out["stall_ms_per_step"] = sums["fetch_stall_ms"] / sums["steps"]
    return out.reset_index()


def compare_fetch(fetch: pd.DataFrame, scheduler: str,
                  against: tuple[str, ...] = ("random",), alpha: float = 0.05) -> pd.DataFrame:
    """Paired tests of ``scheduler`` against each of ``against`` at every shared budget.

    Per (policy, budget, other) the difference in correct answers (summed over seeds) is formed
    per sequence; the table gives the sequences better and worse, the mean difference, the
    one-sided p-values (t and sign-flip permutation, exact up to 16 sequences) and the
    Holm-adjusted permutation p-value over all rows.
    """
    cols = ["score", "design", "fetch_budget", "other", "n_sequences", "better", "worse",
            "mean_diff", "p_t", "p_perm", "p_holm", "reject"]
    per = (fetch.assign(correct=fetch["correct"].astype(float))
           .groupby(POLICY_KEYS + ["fetch_budget", "sequence_id", "fetch_scheduler"],
                    dropna=False)["correct"].sum().unstack("fetch_scheduler"))
    rows = []
    if scheduler in per:
        for key, block in per.groupby(level=POLICY_KEYS + ["fetch_budget"], dropna=False):
            for other in against:
                if other not in block or block[[scheduler, other]].dropna().empty:
                    continue
                pair = block[[scheduler, other]].dropna()
                d = (pair[scheduler] - pair[other]).to_numpy()
                p_t, p_perm = _one_sided_p(d)
                rows.append({"score": key[0], "design": key[1], "fetch_budget": key[-1],
                             "other": other, "n_sequences": d.size,
                             "better": int((d > 0).sum()), "worse": int((d < 0).sum()),
                             "mean_diff": float(d.mean()), "p_t": p_t, "p_perm": p_perm})
    table = pd.DataFrame(rows, columns=cols[:-2])
    if table.empty:
        return pd.DataFrame(columns=cols)
    adj = holm({str(i): p for i, p in enumerate(table["p_perm"])}, alpha=alpha)
    table["p_holm"] = [adj.get(str(i), (np.nan, False))[0] for i in range(len(table))]
    table["reject"] = [adj.get(str(i), (np.nan, False))[1] for i in range(len(table))]
    return table


def fetch_figure(table: pd.DataFrame, full_accuracy: float | None = None,
                 path: str | Path | None = None) -> bytes:
    """Accuracy against bytes moved (share of refetching every evicted page), per scheduler.

    ``table`` is :func:`fetch_table`'s output; one panel per base policy would crowd the
    report, so policies are told apart by the line label. Returns the PNG bytes.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for key, g in table.groupby(["score", "design", "fetch_scheduler"], dropna=False):
        g = g.sort_values("fetch_budget")
        name = key[2] if table[["score", "design"]].drop_duplicates().shape[0] == 1 \
            else f"{key[0]}/{key[1]}: {key[2]}"
        style = "--" if key[2] == "oracle" else "-"
        ax.plot(g["bytes_share"].fillna(0.0), g["accuracy"], style, marker="o", label=name)
    if full_accuracy is not None and np.isfinite(full_accuracy):
        ax.axhline(full_accuracy, color="k", lw=0.8, ls=":", label="full cache")
    ax.set_xlabel("bytes moved / bytes of every evicted page (all steps and layers)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, bbox_to_anchor=(1.02, 1), loc="upper left")
    ax.set_title("In-loop fetches (oracle dashed: not deployable)", fontsize=10)
    png = png_bytes(fig)
    if path is not None:
        Path(path).write_bytes(png)
    return png
