"""Claims on spending memory or compute where the certificate points: C5 (certificate-gated
escalation of the eviction budget) and C7 (recomputation scheduling).

C5 is computed in DuckDB (:class:`tracesim.analysis.aggregate.ResultsDataset`): its rule ranks
units (sequence, layer, head, query) by their certificate, so the rows are first averaged over
seeds to one row per (unit, budget) in SQL, the ranking is a window over those units, and only
per-sequence means come back to Python (:func:`c5_sequence_means`). C7's random gate draws a
permutation of each (sequence, configuration) cluster's rows in the table's order, so C7 reads
six columns of the certified decode rows, sorted by DuckDB and handed over one cluster at a
time (:func:`c7_clusters`): memory is one cluster, not the table.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats
from tracesim.analysis.aggregate import READ_BATCH_ROWS, notna, quote, record_batches, sql_in
from tracesim.analysis.claims import (
    INCONCLUSIVE,
    NOT_EVALUATED,
    NOT_SUPPORTED,
    SUPPORTED,
    ClaimInputs,
    ClaimResult,
    certified_where,
    eviction_where,
)
from tracesim.analysis.claims_replay import _as_dataset, _claim
from tracesim.analysis.equivalence import paired_tost

__all__ = ["RECOMPUTE_BUDGETS", "c5_claim", "c5_sequence_means", "c7_claim", "c7_clusters",
           "evaluate_c5", "evaluate_c7", "recompute_curves", "token_logprobs"]

#: Recompute budgets of C7's curves (shares of (decode step, head) units).
RECOMPUTE_BUDGETS = (0.05, 0.1, 0.2)
#: C5's escalation unit (with the score): the rule ranks these by their certificate.
C5_UNIT = ("sequence_id", "layer", "head", "query_position")


def c5_where(ds) -> str | None:
    """SQL: the rows C5 escalates over (certified eviction rows of the uniform Poisson design
    at fraction budgets); None when the results lack the columns that say so."""
    if ds.empty or not {"design", "budget_unit", "allocator", "score", "rel_err",
                        *C5_UNIT} <= set(ds.columns):
        return None
    return (f"{eviction_where(ds)} AND {certified_where()} AND \"design\" = 'poisson' AND "
            "\"budget_unit\" = 'fraction' AND \"allocator\" = 'uniform'")


def c5_sequence_means(results) -> list[pd.DataFrame]:
    """Per score and budget triple ``lo < mid < hi`` (consecutive budgets of the score): the
    per-sequence means of the gated error (the units with the largest certificates at ``lo``
    escalated to ``hi`` until the mean budget is ``mid``, the rest at ``lo``) and of the
    uniform error at ``mid``, indexed by sequence, with ``score`` and ``budget`` (``mid``).

    Each (unit, budget) is the mean over its rows (seeds, configurations of the design); a
    unit lacking an error or a certificate at any of its score's budgets is left out. Ties in
    the certificate rank in the units' sorted order (pandas' ``rank(method="first")`` over a
    sorted pivot). Everything but the per-sequence means stays in DuckDB.
    """
    ds = _as_dataset(results)
    where = c5_where(ds)
    if where is None:
        return []
    keys = ", ".join(map(quote, C5_UNIT))
    con = ds.connection()
    scores = ds.query(f"SELECT DISTINCT \"score\" FROM results WHERE {where} AND \"score\" IS "
                      "NOT NULL ORDER BY \"score\"")["score"].tolist()
    out: list[pd.DataFrame] = []
    for score in scores:
        rows = f"{where} AND {sql_in('score', [score])}"
        budgets = sorted(ds.query(f"SELECT DISTINCT \"budget\" FROM results WHERE {rows} AND "
                                  f"{notna('budget')}")["budget"].astype(float))
        if len(budgets) < 3:
            continue
        nonnull = " AND ".join(f"{quote(k)} IS NOT NULL" for k in C5_UNIT)
        # one row per (unit, budget): the mean over its rows, NaN errors not counted
        con.execute(
            f"CREATE OR REPLACE TEMP TABLE c5_cells AS SELECT {keys}, \"budget\", "
            f"AVG(CASE WHEN {notna('rel_err')} THEN CAST(\"rel_err\" AS DOUBLE) END) AS re, "
            f"AVG(CAST(\"cert2\" AS DOUBLE)) AS c FROM results WHERE {rows} AND {nonnull} "
            f"AND {notna('budget')} GROUP BY {keys}, \"budget\"")
        # the units with an error and a certificate at every budget of the score
        con.execute(
            f"CREATE OR REPLACE TEMP TABLE c5_units AS SELECT c5_cells.* FROM c5_cells SEMI "
            f"JOIN (SELECT {keys} FROM c5_cells GROUP BY {keys} HAVING count(*) FILTER "
            f"(WHERE re IS NOT NULL AND c IS NOT NULL) = {len(budgets)}) USING ({keys})")
        n = int(con.sql("SELECT count(*) FROM c5_units").fetchall()[0][0]) // len(budgets)
        for lo, mid, hi in zip(budgets, budgets[1:], budgets[2:], strict=False):
            if n == 0:
                continue
            # rank <= frac * units, as pandas compares the rank with that float
            k = math.floor((mid - lo) / (hi - lo) * n)
            at = "SELECT {keys}, re{extra} FROM c5_units WHERE \"budget\" = CAST('{b!r}' AS DOUBLE)"
            means = ds.query(
                f"SELECT \"sequence_id\", AVG(CASE WHEN rn <= {k} THEN h.re ELSE l.re END) AS "
                f"gated, AVG(m.re) AS uniform FROM ("
                + at.format(keys=keys, b=lo, extra=f", row_number() OVER (ORDER BY c DESC, "
                            f"{keys}) AS rn") + ") AS l JOIN ("
                + at.format(keys=keys, b=mid, extra="") + f") AS m USING ({keys}) JOIN ("
                + at.format(keys=keys, b=hi, extra="") + f") AS h USING ({keys}) "
                "GROUP BY \"sequence_id\" ORDER BY \"sequence_id\"")
            out.append(means.set_index("sequence_id").assign(score=score, budget=mid))
        con.execute("DROP TABLE IF EXISTS c5_units")
        con.execute("DROP TABLE IF EXISTS c5_cells")
    return out


def evaluate_c5(results, prereg) -> ClaimResult:
    """Certificate-gated escalation vs the uniform budget at matched mean memory.

    For base budget b and escalated budget b'' > b' > b from the grid, escalate the units
    (sequence, layer, head, query) with the largest certificates at b until the mean budget is
    b', and compare their error with the uniform budget b' (paired TOST by sequence). The
    per-sequence means come from :func:`c5_sequence_means` (DuckDB).
    """
    claim, alpha = _claim(prereg, "C5")
    res = ClaimResult("C5", claim["hypothesis"])
    diffs = c5_sequence_means(results)
    if not diffs:
        res.detail = ("needs certified poisson rows at three or more fraction budgets "
                      "(uniform allocator)")
        return res
    both = pd.concat(diffs).groupby(level=0)[["gated", "uniform"]].mean()  # per sequence
    if len(both) < 2:
        res.detail = "too few (sequence, budget) pairs"
        return res
    margin = float(claim["margin"])
    test = paired_tost(both["gated"].to_numpy(), both["uniform"].to_numpy(), margin,
                       alpha=alpha)
    res.estimate, res.ci_low, res.ci_high, res.pvalue = (test.mean_difference, test.ci_low,
                                                         test.ci_high, test.pvalue)
    if test.supported:
        res.verdict = SUPPORTED
    elif test.ci_high < -margin:
        res.verdict = NOT_SUPPORTED  # gating is better beyond the margin: it adds something
    else:
        res.verdict = INCONCLUSIVE
    res.detail = (f"rel. error, gated - uniform at matched mean budget, averaged per sequence "
                  f"over scores and budgets, {len(both)} sequences, margin ±{margin}")
    return res


def c7_clusters(results, batch_rows: int = READ_BATCH_ROWS
                ) -> Iterator[tuple[str, str, pd.DataFrame]]:
    """The rows C7 schedules recomputation over (certified decode rows of the Poisson design),
    one (sequence, configuration) cluster at a time in sorted key order, each cluster's rows in
    the table's order (its random gate draws a permutation of them).

    The clusters are numbered in their sorted key order first (one row per cluster); DuckDB
    then sorts the filtered rows by that number and the row's position (numbers only, out of
    core, under the memory limit) and they arrive in batches: memory holds one batch and one
    cluster, never the table and never a row's text. The random gate needs each row of a
    cluster, so this is the one claim input that is rows, not sums.
    """
    ds = _as_dataset(results)
    cols = ["err2", "cert2", "query_position", "prompt_length"]
    if ds.empty or not {"design", "query_role", "sequence_id", "config_id", *cols} <= set(
            ds.columns):
        return
    where = (f"{certified_where()} AND \"design\" = 'poisson' AND \"query_role\" = 'decode' "
             "AND \"sequence_id\" IS NOT NULL AND \"config_id\" IS NOT NULL")
    con = ds.connection()
    con.execute("CREATE OR REPLACE TEMP TABLE c7_keys AS SELECT \"sequence_id\", \"config_id\", "
                "(row_number() OVER (ORDER BY \"sequence_id\", \"config_id\") - 1)::BIGINT AS k "
                f"FROM (SELECT DISTINCT \"sequence_id\", \"config_id\" FROM results WHERE {where})")
    keys = con.sql("SELECT \"sequence_id\", \"config_id\" FROM c7_keys ORDER BY k").fetchall()
    sql = (f"SELECT c7_keys.k, {', '.join(quote(c) for c in cols)} FROM results "
           f"JOIN c7_keys USING (\"sequence_id\", \"config_id\") WHERE {where} "
           "ORDER BY c7_keys.k, results.__row")
    reader = record_batches(con, sql, batch_rows)
    carry: dict[str, np.ndarray] | None = None
    try:
        for batch in reader:
            part = {name: batch.column(i).to_numpy(zero_copy_only=False)
                    for i, name in enumerate(["k", *cols])}
            if carry is not None:
                part = {c: np.concatenate([carry[c], part[c]]) for c in part}
            k = part["k"]
            # cluster boundaries; the last cluster may go on in the next batch
            starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
            for a, b in zip(starts[:-1], starts[1:], strict=True):
                yield (*keys[int(k[a])], pd.DataFrame({c: part[c][a:b] for c in cols}))
            carry = {c: v[starts[-1]:] for c, v in part.items()}
        if carry is not None and len(carry["k"]):
            yield (*keys[int(carry["k"][0])], pd.DataFrame({c: carry[c] for c in cols}))
    finally:
        del reader
        con.execute("DROP TABLE IF EXISTS c7_keys")


def recompute_curves(results, logprobs: dict[str, np.ndarray] | None,
                     budgets: tuple[float, ...], seed: int = 0,
                     read_batch_rows: int = READ_BATCH_ROWS) -> pd.DataFrame:
    """Fraction of squared attention error recovered by recomputing a share of (step, head)
    units, per sequence and gate (certificate, random, confidence).

    Recomputing a unit restores the full-cache output for that decode step and head, so the
    recovered error is the err2 of the chosen units over the total. ``confidence`` recomputes
    whole decode steps in order of the full-cache token log-prob (lowest first). The rows
    come one cluster at a time (:func:`c7_clusters`, ``read_batch_rows`` a batch).
    """
    # per cluster: its keys, its gates and one float per (budget, gate); the frame is built
    # once at the end (no per-row dict)
    sids, cfgs, gates, recovered = [], [], [], []
    rng = np.random.default_rng(seed)
    for sid, cfg, g in c7_clusters(results, read_batch_rows):
        err = g["err2"].to_numpy()
        total = err.sum()
        if total <= 0:
            continue
        order = {"certificate": np.argsort(-g["cert2"].to_numpy(), kind="stable"),
                 "random": rng.permutation(len(g))}
        if logprobs is not None and sid in logprobs:
            lp = logprobs[sid]
            step = g["query_position"].to_numpy() - g["prompt_length"].to_numpy() + 1
            conf = np.where((step >= 0) & (step < lp.size), lp[np.clip(step, 0, lp.size - 1)],
                            0.0)
            order["confidence"] = np.argsort(conf, kind="stable")
        rec = []
        for r in budgets:
            k = int(round(r * len(g)))
            rec += [float(err[idx[:k]].sum() / total) for idx in order.values()]
        sids.append(sid)
        cfgs.append(cfg)
        gates.append(tuple(order))
        recovered.append(np.array(rec, dtype=np.float64))
    if not recovered:
        return pd.DataFrame()
    per = [len(r) for r in recovered]
    return pd.DataFrame({
        "sequence_id": np.repeat(np.array(sids, dtype=object), per),
        "config_id": np.repeat(np.array(cfgs, dtype=object), per),
        "budget": np.concatenate([np.repeat(np.asarray(budgets, dtype=np.float64), len(g))
                                  for g in gates]),
        "gate": np.concatenate([np.tile(np.array(g, dtype=object), len(budgets))
                                for g in gates]),
        "recovered": np.concatenate(recovered)})


def evaluate_c7(curves: pd.DataFrame, prereg) -> ClaimResult:
    """Certificate gating vs random and confidence gating at equal recompute budget."""
    claim, alpha = _claim(prereg, "C7")
    res = ClaimResult("C7", claim["hypothesis"])
    if curves.empty:
        res.detail = "no certified decode rows to schedule recomputation over"
        return res
    piv = curves.pivot_table(index=["sequence_id", "config_id", "budget"], columns="gate",
                             values="recovered")
    others = [c for c in ("random", "confidence") if c in piv]
    pvals, diffs = [], {}
    for other in others:
        # Average within each sequence first: its configs and budgets share the same tokens, so
        # the independent units are the sequences.
        d = (piv["certificate"] - piv[other]).dropna().groupby(level="sequence_id").mean()
        if len(d) < 2 or d.std(ddof=1) == 0:
            pvals.append(0.0 if len(d) and d.mean() > 0 else 1.0)
            diffs[other] = float(d.mean()) if len(d) else np.nan
            continue
        t = d.mean() / (d.std(ddof=1) / np.sqrt(len(d)))
        pvals.append(float(stats.t.sf(t, len(d) - 1)))
        diffs[other] = float(d.mean())
    # Intersection-union: certificate must beat every alternative.
    res.pvalue = max(pvals) if pvals else np.nan
    worst = min(diffs, key=lambda k: diffs[k]) if diffs else None
    res.estimate = diffs[worst] if worst else np.nan
    if res.pvalue < alpha:
        res.verdict = SUPPORTED
    elif any(v < 0 for v in diffs.values()) and len(piv) > 1:
        res.verdict = NOT_SUPPORTED if min(diffs.values()) < -0.05 else INCONCLUSIVE
    else:
        res.verdict = INCONCLUSIVE
    if not others:
        res.verdict = NOT_EVALUATED
    res.detail = ("recovered-error fraction, certificate minus " + ", ".join(
        f"{k} ({v:+.3f})" for k, v in diffs.items()) + f"; one-sided paired t-tests over "
        f"{piv.index.get_level_values('sequence_id').nunique()} sequences (each the mean over "
        f"its configs and budgets); gates compared: {['certificate'] + others}")
    res.extra = {"differences": diffs}
    return res


def token_logprobs(traces_dir: str | Path) -> dict[str, np.ndarray]:
    """Generated-token log-probs per sequence id, from a trace store's manifest (for C7's
    confidence gate)."""
    from tracesim.store import open_store

    store = open_store(traces_dir)
    m = store.manifest.select(["sequence_id", "generated_logprobs"]).to_pylist()
    return {r["sequence_id"]: np.asarray(r["generated_logprobs"], dtype=float) for r in m}




def c5_claim(inputs: ClaimInputs) -> ClaimResult:
    """C5 from the replay results."""
    return evaluate_c5(inputs.results, inputs.prereg)


def c7_claim(inputs: ClaimInputs) -> ClaimResult:
    """C7; leaves its recovered-error curves as ``artifacts["C7 curves"]``."""
    logprobs = token_logprobs(inputs.traces_dir) if inputs.traces_dir else None
    curves = recompute_curves(inputs.results, logprobs, RECOMPUTE_BUDGETS)
    inputs.artifacts["C7 curves"] = curves
    return evaluate_c7(curves, inputs.prereg)
