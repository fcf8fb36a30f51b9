"""The in-loop per-step study (``tracesim evict`` with ``data/sweeps/evict-perstep.yaml``).

From an outcomes table (``OUT/outcomes.parquet``, one row per sequence, configuration and seed)
this gives one row per configuration: accuracy, answers identical to the full cache, tokens,
bytes and modelled time per decode step (``docs/columns.md``, the ``step_*`` columns), the mean
certificate, and paired comparisons over sequences (each sequence's accuracy is its mean over
seeds; sequences are the independent units) against the full cache, against prefill top-k
(SnapKV) at the same budget, and, for a randomized per-step design, against per-step top-k by
the same proxy. p-values are two-sided sign-flip permutation tests (exact up to 16 sequences),
Holm-adjusted over every comparison of the table. :func:`per_step_claims` evaluates C2, C3 and
C6 on the per-step configurations only, and :func:`accuracy_bytes_figure` plots accuracy
against bytes per step::

    python -m tracesim.analysis.evict_perstep results/evict-perstep [MORE_DIRS ...] \\
        --prereg data/prereg.yaml --figure accuracy_bytes.png
"""

from __future__ import annotations

import argparse
from itertools import product

import numpy as np
import pandas as pd
from tracesim.analysis.multiplicity import holm
from tracesim.analysis.plotting import png_bytes, pyplot

from tracesim.safeio import loads_json

__all__ = ["REPORT_COLUMNS", "accuracy_bytes_figure", "add_to_report", "configuration_label",
           "load_many", "outcome_table", "per_step_claims", "sign_flip_p"]

#: Monte Carlo sign patterns beyond 16 sequences (fixed seed: reruns give the same p).
SIGN_FLIP_DRAWS = 20000


def sign_flip_p(d: np.ndarray) -> float:
    """Two-sided sign-flip permutation p-value of ``mean(d) = 0`` (NaN with < 2 pairs).

    Exact over every sign pattern up to 16 pairs; beyond, :data:`SIGN_FLIP_DRAWS` patterns
    with a fixed seed and ``(k + 1) / (N + 1)``.
    """
    d = np.asarray(d, dtype=np.float64)
    d = d[np.isfinite(d)]
    if d.size < 2:
        return float("nan")
    obs = abs(float(d.mean()))
    if obs == 0:
        return 1.0
    if d.size <= 16:
        signs = np.array(list(product((1.0, -1.0), repeat=d.size)))
        perm = np.abs((signs * np.abs(d)).mean(axis=1))
        return float((perm >= obs - 1e-15).mean())
    rng = np.random.default_rng(0)
    signs = rng.choice((1.0, -1.0), size=(SIGN_FLIP_DRAWS, d.size))
    perm = np.abs((signs * np.abs(d)).mean(axis=1))
    return float(((perm >= obs - 1e-15).sum() + 1) / (perm.size + 1))


def _proxy(row: pd.Series) -> str:
    if row["score"] != "perstep":
        return ""
    try:
        return str(loads_json(row["score_params"], "score_params").get("proxy", "exact"))
    except (TypeError, ValueError):
        return ""


def configuration_label(row: pd.Series) -> str:
    """``full``, ``snapkv/topk``, ``perstep[quant:4]/poisson step(fresh)``, a peer's label
    (``quest(page=16,budget=0.25)``), ... of one row."""
    if row["score"] in ("full", "peer"):
        return str(row["config_id"])  # a peer's label names it and its parameters
    label = f"{row['score']}/{row['design']}"
    if row["score"] == "perstep":
        label = f"perstep[{_proxy(row)}]/{row['design']}"
    if str(row.get("schedule", "oneshot")) != "oneshot":
        # The schedule's label (with a step schedule's coordination) ends the config id.
        label += " " + str(row["config_id"]).rsplit("|", 1)[-1]
    return label


def _per_sequence(df: pd.DataFrame) -> pd.Series:
    return df.groupby("sequence_id")["correct"].mean()


def _paired(a: pd.Series, b: pd.Series) -> tuple[float, float, int]:
    both = pd.concat([a.rename("a"), b.rename("b")], axis=1).dropna()
    d = (both["a"] - both["b"]).to_numpy(float)
    return (float(d.mean()) if d.size else float("nan")), sign_flip_p(d), int(d.size)


def _mean(g: pd.DataFrame, column: str) -> float:
    return float(pd.to_numeric(g[column], errors="coerce").mean()) if column in g else np.nan


def outcome_table(outcomes: pd.DataFrame, alpha: float = 0.05) -> pd.DataFrame:
    """One row per configuration (module docstring), in the table's order.

    Columns: ``config_id``, ``label``, ``score``, ``design``, ``proxy``, ``budget``,
    ``deployable``, ``certified``, ``runs``, ``sequences``, ``accuracy``, ``same_as_full``
    (share of runs whose tokens are the full cache's), ``step_tokens_fraction``,
    ``step_kib`` (bytes attention reads per step, KiB), ``link_kib``, ``step_us``,
    ``certificate_mean``; for each comparison ``X`` in ``full``, ``snapkv`` and ``topk``:
    ``d_X`` (mean paired accuracy difference), ``p_X``, ``p_X_holm`` and ``n_X`` (pairs).
    """
    df = outcomes.copy()
    df["label"] = df.apply(configuration_label, axis=1)
    df["proxy"] = df.apply(_proxy, axis=1)
    full_rows = df[df["score"] == "full"]
    full = (_per_sequence(full_rows) if not full_rows.empty
            else df.groupby("sequence_id")["full_correct"].mean().astype(float))
    rows = []
    for cid, g in df.groupby("config_id", sort=False):
        first = g.iloc[0]
        row = {"config_id": cid, "label": first["label"], "score": first["score"],
               "design": first.get("design"), "proxy": first["proxy"],
               "budget": first.get("budget"), "deployable": bool(first.get("deployable", True)),
               "certified": bool(first.get("certified", False)), "runs": len(g),
               "sequences": int(g["sequence_id"].nunique()),
               "accuracy": float(_per_sequence(g).mean()),
               "same_as_full": float(g["same_tokens_as_full"].astype(float).mean()),
               "step_tokens_fraction": _mean(g, "step_tokens_fraction"),
               "step_kib": _mean(g, "step_bytes") / 1024,
               "link_kib": _mean(g, "step_link_bytes") / 1024,
               "step_us": _mean(g, "step_us"),
               "certificate_mean": _mean(g, "certificate_mean")}
        acc = _per_sequence(g)
        comparisons = {}
        if first["score"] != "full":
            comparisons["full"] = full
            snap = df[(df["score"] == "snapkv") & (df["design"] == "topk")
                      & (df["budget"] == first.get("budget"))]
            if first["score"] != "snapkv" and not snap.empty:
                comparisons["snapkv"] = _per_sequence(snap)
            if first["score"] == "perstep" and first["design"] != "topk":
                topk = df[(df["score"] == "perstep") & (df["design"] == "topk")
                          & (df["proxy"] == first["proxy"])
                          & (df["budget"] == first.get("budget"))]
                if not topk.empty:
                    comparisons["topk"] = _per_sequence(topk)
        for name in ("full", "snapkv", "topk"):
            d, p, n = _paired(acc, comparisons[name]) if name in comparisons else (
                np.nan, np.nan, 0)
            row.update({f"d_{name}": d, f"p_{name}": p, f"n_{name}": n})
        rows.append(row)
    table = pd.DataFrame(rows)
    tests = {f"{i}:{name}": table.at[i, f"p_{name}"] for i in table.index
             for name in ("full", "snapkv", "topk") if np.isfinite(table.at[i, f"p_{name}"])}
    adjusted = holm(tests, alpha=alpha) if tests else {}
    for name in ("full", "snapkv", "topk"):
        table[f"p_{name}_holm"] = [adjusted.get(f"{i}:{name}", (np.nan,))[0]
                                   for i in table.index]
    return table


def per_step_claims(outcomes: pd.DataFrame, prereg) -> dict:
    """C2, C3 and C6 on the per-step configurations (``schedule`` step) of ``outcomes``.

    * C2: per-step Poisson/Hájek against per-step top-k by the same proxy at the same budget
      (:func:`tracesim.analysis.claims_outcomes.evaluate_c2_accuracy`, pairs by proxy);
    * C3: the deployable certified per-step designs against the full cache (paired
      non-inferiority, each sequence's mean over those designs and seeds, C3's margin);
    * C6: :func:`tracesim.analysis.claims_outcomes.evaluate_c6` on the certified per-step runs.

    Returns ``{"C2": dict, "C3": ClaimResult, "C6": ClaimResult}``.
    """
    from tracesim.analysis.claims import INCONCLUSIVE, NOT_SUPPORTED, SUPPORTED, ClaimResult
    from tracesim.analysis.claims_outcomes import evaluate_c2_accuracy, evaluate_c6
    from tracesim.analysis.equivalence import paired_noninferiority

    step = outcomes[outcomes["schedule"].astype(str) == "step"].copy()
    step["score"] = "perstep[" + step.apply(_proxy, axis=1) + "]"
    out: dict = {"C2": evaluate_c2_accuracy(step, 0.05, prereg.claim_alpha("C2"))}
    claim = prereg.claims["C3"]
    res = ClaimResult("C3", claim["hypothesis"] + " (per-step designs, in the loop)")
    chosen = step[step["deployable"].astype(bool) & step["certified"].astype(bool)]
    per = chosen.groupby("sequence_id").agg(acc=("correct", "mean"),
                                            full=("full_correct", "mean"))
    if len(per) < 2:
        res.detail = "needs deployable certified per-step outcomes on >= 2 sequences"
    else:
        margin = float(claim["margin"])
        test = paired_noninferiority(per["acc"].to_numpy(float), per["full"].to_numpy(float),
                                     margin, alpha=prereg.claim_alpha("C3"))
        res.estimate, res.ci_low, res.pvalue = test.mean_difference, test.ci_low, test.pvalue
        if test.supported:
            res.verdict = SUPPORTED
        elif -test.mean_difference > margin and -test.ci_low > margin:
            res.verdict = NOT_SUPPORTED
        else:
            res.verdict = INCONCLUSIVE
        res.detail = (f"accuracy (per-step - full) over {len(per)} sequences, mean over "
                      f"{chosen['config_id'].nunique()} deployable certified per-step "
                      f"configurations; margin {margin}; one-sided lower bound "
                      f"{test.ci_low:+.3f}")
    out["C3"] = res
    out["C6"] = evaluate_c6(step, prereg)[0]
    return out


def accuracy_bytes_figure(table: pd.DataFrame) -> tuple[bytes, str] | None:
    """Accuracy against bytes attention reads per decode step, one point per configuration."""
    t = table[np.isfinite(table["step_kib"])]
    if t.empty:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for kind, marker in (("full", "s"), ("snapkv", "D"), ("perstep", "o"), ("peer", "^")):
        g = t[t["score"] == kind]
        if not g.empty:
            ax.scatter(g["step_kib"], g["accuracy"], marker=marker, label=kind, alpha=0.85)
    # Configurations at (nearly) the same point share one stacked annotation.
    spot = pd.DataFrame({"x": np.round(np.log10(t["step_kib"]), 1), "y": t["accuracy"],
                         "label": t["label"].str.replace("perstep", "ps"),
                         "kib": t["step_kib"]})
    for (_, y), g in spot.groupby(["x", "y"]):
        ax.annotate("\n".join(g["label"]), (float(g["kib"].iloc[0]), float(y)), fontsize=6,
                    xytext=(4, -2), textcoords="offset points", va="top")
    ax.set_xscale("log")
    ax.set_xlabel("bytes attention reads per decode step (KiB, all layers and KV heads)")
    ax.set_ylabel("accuracy (share correct)")
    ax.set_ylim(-0.12, 1.02)  # room for the labels of points at 0
    ax.legend(fontsize=7)
    n = int(t["sequences"].max())
    caption = (f"In-loop accuracy against the bytes attention reads per decode step ({n} "
               "sequences; mean over sequences of each sequence's share correct over seeds). "
               "Bytes: attended tokens x token bytes, plus the proxy's summary for per-step "
               "designs (the tiers memory model, docs/columns.md).")
    return png_bytes(fig), caption


#: Columns of the report's table.
REPORT_COLUMNS = ("label", "runs", "sequences", "accuracy", "same_as_full",
                  "step_tokens_fraction", "step_kib", "link_kib", "step_us", "certificate_mean",
                  "d_full", "p_full_holm", "d_snapkv", "p_snapkv_holm", "d_topk", "p_topk_holm")


def add_to_report(report, outcomes: pd.DataFrame, prereg) -> None:
    """The in-loop per-step table, its claims (C2, C3, C6 on per-step rows) and the
    accuracy-bytes figure, into an :class:`tracesim.analysis.report.Report` (nothing without
    per-step
    outcomes)."""
    if "schedule" not in outcomes or not (outcomes["schedule"].astype(str) == "step").any():
        return
    table = outcome_table(outcomes, alpha=prereg.alpha)
    report.tables["per-step designs in the loop: outcomes per configuration"] = (
        table[list(REPORT_COLUMNS)].to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    claims = per_step_claims(outcomes, prereg)
    c2 = claims["C2"]
    lines = ["C2 end to end (per-step Poisson vs per-step top-k, same proxy): "
             + (f"difference {c2['accuracy_difference']:+.3f} over {c2['accuracy_pairs']} "
                f"sequences, TOST p = {c2['accuracy_tost_p']:.3g}" if c2 else "too few pairs")]
    lines += [f"{c}: {claims[c].verdict}; {claims[c].detail}" for c in ("C3", "C6")]
    report.tables["per-step designs in the loop: C2, C3, C6"] = "\n".join(lines)
    report.add_figure("accuracy_vs_bytes", accuracy_bytes_figure(table))


def load_many(directories: list[str]) -> tuple[pd.DataFrame, int]:
    """The outcomes of several ``tracesim evict`` directories (each checked against its
    summary, :func:`tracesim.analysis.results_io.load_outcomes`), as one table.

    A row whose key (sequence, configuration, seed, fetch) is already in an earlier directory
    is dropped, so a configuration run in two directories (the full cache, say) counts once;
    returns the table and the number of rows dropped."""
    from tracesim.analysis.results_io import load_outcomes

    from tracesim.integrity import OUTCOME_KEYS

    frames = [load_outcomes(d)[0] for d in directories]
    both = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    keys = [k for k in OUTCOME_KEYS if k in both.columns]
    dup = both.duplicated(keys, keep="first")
    return both[~dup].reset_index(drop=True), int(dup.sum())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="+", help="tracesim evict output directories (their "
                        "outcomes are joined; a row already in an earlier one is dropped)")
    parser.add_argument("--prereg", default=None, help="pre-registration (C2, C3, C6)")
    parser.add_argument("--figure", default=None, help="write the accuracy-bytes PNG here")
    args = parser.parse_args(argv)
    import sys

    try:
        outcomes, dropped = load_many(args.out)
    except (ValueError, OSError) as exc:
        print(f"python -m tracesim.analysis.evict_perstep: {exc}", file=sys.stderr)
        return 2
    if dropped:
        print(f"{dropped} rows already in an earlier directory dropped")
    table = outcome_table(outcomes)
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        print(table[list(REPORT_COLUMNS)].round(3).to_string(index=False))
    if args.prereg:
        from tracesim.analysis.prereg import load_prereg

        claims = per_step_claims(outcomes, load_prereg(args.prereg))
        print("C2 (per-step, end to end):", claims["C2"] or "too few pairs")
        for c in ("C3", "C6"):
            print(f"{c}: {claims[c].verdict} — {claims[c].detail}")
    if args.figure:
        fig = accuracy_bytes_figure(table)
        if fig is not None:
            from pathlib import Path

            Path(args.figure).write_bytes(fig[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
