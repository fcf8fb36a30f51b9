"""Per-step designs against their deterministic baseline and the prefill designs.

For every configuration of a replay or sweep output: Wald and Wald-t coverage of all rows (no
validity rule), the mean squared error, the ratio of that error to per-query top-k by the same
proxy at the same budget (the deterministic baseline at equal kept tokens), the mean kept
tokens per step and the proxy's fast-memory cost. Coverage carries a cluster-robust 95 %
interval by sequence (the rows of one sequence are not independent).

With ``--calibration DIR`` it also fits a split-conformal radius per configuration on the
calibration results and reports its held-out coverage: ``kappa`` is the smallest multiple with
``|o_hat - o| <= kappa C`` on a 95 % share of calibration rows (the ``ceil((n + 1) 0.95)``-th
smallest ``|o_hat - o| / C``), ``conf_cov`` the held-out share with ``|o_hat - o| <= kappa C``.
With ``--prereg`` it evaluates claims C9 and C11 (from the results) and C10 (from ``--peers`` output
of ``tracesim peers``), as ``tracesim report`` does (:mod:`tracesim.analysis.claims_perstep`).

With ``--by COLUMN`` (e.g. ``store`` for the length sweep) it prints one table per value of that
column, each with its own top-k baseline and costs.

Usage: ``python -m tracesim.analysis.perstep RESULTS_DIR [--calibration DIR] [--peers DIR ...]
[--prereg data/prereg.yaml] [--by COLUMN] [--scheduler ADDRESS]`` (``docs/perstep.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from tracesim.analysis.claims_perstep import c9_from_sums, evaluate_c9, evaluate_c10, perstep_sums
from tracesim.analysis.cluster import cluster_mean, student_quantile
from tracesim.analysis.perstep_costs import cost_columns
from tracesim.analysis.prereg import load_prereg
from tracesim.analysis.results_io import load_peers

# evaluate_c9 and evaluate_c10 live with the other claims (tracesim.analysis.claims_perstep); they
# are
# named here too because this command evaluates them.
__all__ = ["perstep_table", "by_table", "conformal_radius", "evaluate_c9", "evaluate_c10", "main"]


def _cluster_ci(values: pd.Series, clusters: pd.Series) -> tuple[float, float]:
    """Mean and cluster-robust 95 % half-width (Student ``t_{k-1}``) of a column."""
    m, se, k = cluster_mean(values, clusters)
    return m, student_quantile(0.975, k) * se


def _proxy(row: pd.Series) -> str:
    if row["score"] != "perstep":
        return "—"
    return str(json.loads(row["score_params"]).get("proxy", "exact"))


def _gqa(row: pd.Series) -> str:
    """How a per-step design samples the GQA group: ``mean``, ``max`` or ``head`` (one sample
    per query head); ``—`` for the other scores."""
    if row["score"] != "perstep":
        return "—"
    return str(json.loads(row["score_params"]).get("gqa", "mean"))


def perstep_table(df: pd.DataFrame, head_dim: int = 64) -> pd.DataFrame:
    """One row per configuration (see the module docstring), sorted as the study lists them.

    ``gqa`` says how a per-step design samples the GQA group; a configuration's top-k baseline
    is the one with its score, proxy, ``gqa`` and budget, else the group-shared (``mean``)
    one."""
    rows = []
    first = df.drop_duplicates("config_id").set_index("config_id")
    for cid, g in df.groupby("config_id", sort=False):
        cov, hw = _cluster_ci(g["wald_cov"], g["sequence_id"])
        cov_t, _ = _cluster_ci(g["wald_t_cov"], g["sequence_id"])
        rows.append(table_row(str(cid), first.loc[cid], (cov, hw, cov_t), len(g),
                              float(g["err2"].mean()), float(g["kept_tokens"].mean()),
                              head_dim))
    return with_topk_ratio(pd.DataFrame(rows))


def table_row(cid: str, meta: pd.Series, coverage: tuple[float, float, float], n_rows: int,
              mse: float, kept: float, head_dim: int = 64) -> dict:
    """One configuration's row of :func:`perstep_table` from its first row ``meta``, its
    (Wald coverage, its 95 % half-width, Wald-t coverage), row count, mean err2 and mean kept
    tokens."""
    from tracesim.proxies import make_proxy

    proxy = _proxy(meta)
    return {
        "score": meta["score"], "proxy": proxy, "gqa": _gqa(meta), "design": meta["design"],
        "schedule": cid.split("|")[4] if cid != "full" else "—",
        "budget": meta["budget"], "rows": n_rows,
        "wald": coverage[0], "wald_ci": coverage[1], "wald_t": coverage[2], "mse": mse,
        "kept": kept,
        "proxy_bits": (make_proxy(proxy).bits_per_token(head_dim) if proxy != "—"
                       else float("nan")),
    }


def with_topk_ratio(out: pd.DataFrame) -> pd.DataFrame:
    """``mse_vs_topk``: each row's error over per-query top-k's with its score, proxy, ``gqa``
    and budget (else the group-shared one)."""
    topk = out[out.design == "topk"].set_index(["score", "proxy", "gqa", "budget"])["mse"]

    def baseline(r) -> float:
        for gqa in (r.gqa, "mean"):
            key = (r.score, r.proxy, gqa, r.budget)
            if key in topk.index:
                found = topk[key]
                if isinstance(found, pd.Series):  # not one baseline: say so, not a traceback
                    raise ValueError(
                        f"{len(found)} top-k configurations share score {r.score!r}, proxy "
                        f"{r.proxy!r}, gqa {gqa!r} and budget {r.budget:g}: expected one "
                        "baseline each; split the table with --by COLUMN (e.g. allocator)")
                return float(found)
        return np.nan

    out["mse_vs_topk"] = [r.mse / baseline(r) for r in out.itertuples()]
    return out


def by_table(df: pd.DataFrame, column: str, head_dim: int = 64) -> pd.DataFrame:
    """:func:`perstep_table` with the cost columns, computed separately for each value of a
    result column (first column of the output). Each part has its own per-query top-k
    baseline and its own cached-token count ``P``, so a length sweep's stores stay apart."""
    if column not in df.columns:
        raise ValueError(f"--by {column!r}: not a result column; expected one of "
                         f"{sorted(df.columns)[:12]}...")
    parts = []
    for value, g in df.groupby(column, sort=False):
        t = cost_columns(perstep_table(g, head_dim), g, head_dim)
        t.insert(0, column, value)
        parts.append(t)
    return pd.concat(parts, ignore_index=True)


def _ratio(g: pd.DataFrame) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(g["err2"].to_numpy(float) / g["cert2"].to_numpy(float))


def conformal_radius(cal: pd.DataFrame, level: float = 0.95) -> dict[str, float]:
    """Split-conformal radius per certified configuration (see the module docstring)."""
    out = {}
    for cid, g in cal[cal["certified"]].groupby("config_id"):
        r = np.sort(np.where(np.isnan(_ratio(g)), np.inf, _ratio(g)))
        k = int(np.ceil((r.size + 1) * level)) - 1
        out[cid] = float(r[min(k, r.size - 1)]) if k < r.size else float("inf")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tracesim.analysis.perstep", description=__doc__
                                 .splitlines()[0])
    ap.add_argument("results", help="a replay or sweep output directory")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--calibration", default=None,
                    help="results whose rows fit the conformal radius (another set of sequences)")
    ap.add_argument("--peers", nargs="*", default=[], help="tracesim peers output directories")
    ap.add_argument("--prereg", default=None, help="evaluate C9, C11 and C10 of this file")
    ap.add_argument("--by", default=None, metavar="COLUMN",
                    help="one table per value of this result column, e.g. 'store' for a "
                         "length sweep (each value's own top-k baseline and costs)")
    ap.add_argument("--scheduler", default=None, metavar="ADDRESS",
                    help="compute the per-configuration sums with Dask on this scheduler "
                    "(tcp://HOST:PORT, threads, processes or synchronous; default: DuckDB)")
    args = ap.parse_args(argv)
    try:
        from tracesim.analysis.aggregate import open_results
        from tracesim.analysis.perstep_stream import (
            by_table_from,
            conformal_columns,
            perstep_costs_table,
        )

        if args.by and args.calibration:
            raise ValueError("--by and --calibration: give one of them")
        # verified and opened, never loaded whole: the table from per-configuration sums, the
        # conformal radius from one configuration's certified rows at a time
        ds = open_results(Path(args.results), scheduler=args.scheduler)
        table = (by_table_from(ds, args.by, args.head_dim) if args.by else
                 perstep_costs_table(ds, args.head_dim))
        if args.calibration:
            cal = open_results(Path(args.calibration))
            table["kappa"], table["conf_cov"] = conformal_columns(ds, cal)
        claims = []
        if args.prereg:
            pre = load_prereg(args.prereg)
            # C11 is C9's rule on Gemma 3's rows: each evaluates where its rows are; a
            # configuration that cannot be compared fails only when neither claim evaluates
            errors = {}
            for cid in ("C9", "C11"):
                try:
                    by_seq, by_kind, pick = perstep_sums(ds, pre.claims[cid], cid)
                    claims.append(c9_from_sums(by_seq, by_kind, pick, pre.claims[cid],
                                               pre.claim_alpha(cid), cid))
                except ValueError as exc:
                    errors[cid] = str(exc)
            if len(errors) == 2:
                raise ValueError(errors["C9"])
            claims += [{"claim": cid, "verdict": "not evaluated", "reason": why}
                       for cid, why in errors.items()]
            if args.peers:
                peers = load_peers(args.peers)
                claims.append(evaluate_c10(peers, pre.claims["C10"], pre.claim_alpha("C10")))
    except (ValueError, OSError, KeyError) as exc:
        print(f"python -m tracesim.analysis.perstep: {exc}", file=sys.stderr)
        return 2
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        print(table.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    for c in claims:
        print(json.dumps(c, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
