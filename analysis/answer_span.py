"""Why accuracy dropped: how much of the answer span each in-loop configuration kept.

From an outcomes table (``tracesim evict``'s ``OUT/outcomes.parquet``, the ``answer_*`` columns
of :mod:`tracesim.capture.inloop.answer`) this gives one row per configuration: the runs whose
sequence
has a located answer span, the mean share of span tokens kept (over layers, KV heads and decode
steps), the same for the tokens of the answer's first and of its last digit, and accuracy split
by whether the whole span was kept in every layer and KV head (``answer_kept_min == 1``, at
every decode step for per-step designs). Runs without a span are left out; a table without any
span gives nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

__all__ = ["CONFIG_KEYS", "add_to_report", "answer_span_table"]

#: The configuration keys the end-to-end accuracy table groups by.
CONFIG_KEYS = ("score", "design", "correction", "budget")
_TABLE = "answer span kept (next to end-to-end accuracy)"


def answer_span_table(outcomes: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration of the runs with an answer span.

    Parameters
    ----------
    outcomes : pandas.DataFrame
        Outcome rows with ``correct``, the :data:`CONFIG_KEYS` and the ``answer_*`` columns.

    Returns
    -------
    pandas.DataFrame
        Indexed by :data:`CONFIG_KEYS`; columns ``runs``, ``accuracy``, ``answer_kept``
        (mean ``answer_kept_share``), ``first_digit_kept`` and ``last_digit_kept`` (means of
        ``answer_first_kept_share`` / ``answer_last_kept_share``), ``pi_mean`` (mean
        ``answer_pi_mean``; NaN for deterministic designs), ``whole_kept_runs`` and
        ``accuracy_whole_kept`` (runs with the whole span kept everywhere and their accuracy),
        ``accuracy_partly_lost`` (the other runs' accuracy; NaN where there are none). Empty
        when no run has a span.
    """
    needed = {"answer_kept_share", "answer_kept_min", "correct", *CONFIG_KEYS}
    if outcomes.empty or not needed <= set(outcomes.columns):
        return pd.DataFrame()
    share = pd.to_numeric(outcomes["answer_kept_share"], errors="coerce")
    df = outcomes.loc[share.notna()].copy()
    if df.empty:
        return pd.DataFrame()
    numeric = ("answer_kept_share", "answer_kept_min", "answer_first_kept_share",
               "answer_last_kept_share", "answer_pi_mean")
    for col in numeric:
        df[col] = pd.to_numeric(df[col], errors="coerce") if col in df else np.nan
    df["correct"] = df["correct"].astype(float)
    # Shares are means of 0/1 flags: the whole span is kept everywhere exactly when the
    # smallest per-(layer, KV head) share is 1.
    df["_whole"] = df["answer_kept_min"] >= 1.0
    rows = []
    for key, g in df.groupby(list(CONFIG_KEYS), dropna=False):
        whole, lost = g[g["_whole"]], g[~g["_whole"]]
        rows.append((*key, len(g), g["correct"].mean(), g["answer_kept_share"].mean(),
                     g["answer_first_kept_share"].mean(), g["answer_last_kept_share"].mean(),
                     g["answer_pi_mean"].mean(), len(whole),
                     whole["correct"].mean() if len(whole) else np.nan,
                     lost["correct"].mean() if len(lost) else np.nan))
    cols = [*CONFIG_KEYS, "runs", "accuracy", "answer_kept", "first_digit_kept",
            "last_digit_kept", "pi_mean", "whole_kept_runs", "accuracy_whole_kept",
            "accuracy_partly_lost"]
    return pd.DataFrame(rows, columns=cols).set_index(list(CONFIG_KEYS))


def add_to_report(report: Any, outcomes: pd.DataFrame) -> None:
    """Add :func:`answer_span_table` to ``report.tables`` when some run has an answer span."""
    table = answer_span_table(outcomes)
    if not table.empty:
        report.tables[_TABLE] = table.round(3).to_string()
