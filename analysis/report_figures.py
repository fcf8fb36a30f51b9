"""The report's calibration, accuracy and per-head figures (PNG bytes), with their captions.

Colour scales are fixed by the quantity, not by the data: a coverage map is centred on the
nominal level with the same limits in every panel, and cells backed by too few sequences are
masked, so sampling noise in a small run does not show up as structure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import pandas as pd
from scipy import stats
from tracesim.analysis.coverage import calibration_counts as _counts
from tracesim.analysis.plotting import png_bytes, pyplot

__all__ = ["CalibrationStats", "CertifiedRows", "DesignCalibration", "accuracy_budget_figure",
           "calibration_stats", "certificate_error_figure", "certified_rows", "coverage_heatmap",
           "coverage_level_figure", "heatmap_cells", "policy_labels"]

#: Heatmap cells backed by fewer sequences than this are masked (grey).
MIN_CLUSTERS = 3


def policy_labels(df: pd.DataFrame) -> pd.Series:
    """``score / design`` per row; designs that ignore the score are labelled once,
    ``bernoulli (any score)`` (see :mod:`tracesim.policies.redundancy`)."""
    score = df["score"].astype(str)
    design = df["design"].astype(str)
    mixture = pd.to_numeric(df["mixture"], errors="coerce") if "mixture" in df else \
        pd.Series(np.nan, index=df.index)
    free = (design == "bernoulli") | (mixture == 1.0)
    if "top_fraction" in df:
        free &= pd.to_numeric(df["top_fraction"], errors="coerce").fillna(0) == 0
    if "allocator" in df:
        free &= df["allocator"].astype(str) != "adakv"
    label = score + " / " + design
    return label.where(~free, design + " (any score)")


def _certified(df: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """The certified rows with a positive certificate, only ``columns`` of them (those the
    table has): a figure copies what it draws, not every results column."""
    ok = df["certified"].astype(bool) & df["cert2"].notna() & df["err2"].notna()
    ok &= df["cert2"] > 0
    cols = [c for c in dict.fromkeys(columns) if c in df.columns]
    if ok.all():  # the report's read holds these rows only: select columns, copy nothing
        return df[cols]
    return df.loc[ok, cols]


class CertifiedRows(NamedTuple):
    """What the calibration figures draw of one design: its certified rows' squared
    certificates and squared errors (float64, row order) and how many sequences they cover."""

    cert2: np.ndarray
    err2: np.ndarray
    sequences: int


#: Nominal levels of the coverage-against-level figure.
LEVELS = np.linspace(0.5, 0.99, 50)
#: Edges per axis of the certificate-against-error histogram (geometric, between the limits).
N_EDGES = 40
#: Quantiles of the certificate that split a design's rows into the figure's deciles.
DECILES = np.linspace(0, 1, 11)
#: Quantiles of every positive certificate and error that set the axes (then halved/doubled).
AXIS_QUANTILES = np.array([0.001, 0.999])


class DesignCalibration(NamedTuple):
    """What the two calibration figures draw of one design, reduced from its certified rows
    with a positive certificate: counts and order statistics, no row.

    ``hist`` counts the rows per cell of the figure's edges (certificate by error, each
    clipped to the axes); ``medians`` holds (median C, median |e|) per certificate decile
    (:data:`DECILES`, equal quantiles merged); ``ratio`` is the median of |e| / C;
    ``covered`` counts per level of :data:`LEVELS` the rows with |e| / C <= z_{(1+level)/2}
    out of ``defined`` rows with |e| / C defined (not NaN).
    """

    rows: int
    sequences: int
    hist: np.ndarray
    medians: tuple[tuple[float, float], ...]
    ratio: float
    covered: np.ndarray
    defined: int


class CalibrationStats(NamedTuple):
    """The calibration figures' input: the axis limits shared by every design and each
    design's :class:`DesignCalibration` (designs with rows only)."""

    lo: float
    hi: float
    designs: dict[str, DesignCalibration]

    @property
    def edges(self) -> np.ndarray:
        return np.geomspace(self.lo, self.hi, N_EDGES)


def certified_rows(results: pd.DataFrame) -> dict[str, CertifiedRows]:
    """:class:`CertifiedRows` per design (sorted) of a results table's certified rows with a
    positive certificate and an error."""
    df = _certified(results, ["design", "cert2", "err2", "sequence_id"])
    return {str(d): CertifiedRows(g["cert2"].to_numpy(float), g["err2"].to_numpy(float),
                                  int(g["sequence_id"].nunique()))
            for d, g in df.groupby("design", sort=True)}


def axis_limits(quantiles: np.ndarray | None) -> tuple[float, float]:
    """The figure's axes from :data:`AXIS_QUANTILES` of the positive values (None: none)."""
    lo, hi = quantiles if quantiles is not None else (1e-3, 1.0)
    return lo / 2, hi * 2


def decile_bins(c: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The certificate decile of each certificate ``c`` (``q``: the merged deciles)."""
    return np.clip(np.searchsorted(q, c, side="right") - 1, 0, len(q) - 2)


def calibration_counts(cert2: np.ndarray, err2: np.ndarray) -> tuple[np.ndarray, int]:
    """Per level of :data:`LEVELS`, the rows with |e| / C <= z_{(1+level)/2}, and the rows
    with |e| / C defined (counts add up over batches of rows)."""
    return _counts(np.sqrt(err2 / cert2), LEVELS)


def histogram(cert2: np.ndarray, err2: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Counts of (C, |e|) per cell of the figure's edges, both clipped to ``[lo, hi]`` (counts
    add up over batches of rows)."""
    edges = np.geomspace(lo, hi, N_EDGES)
    h, _, _ = np.histogram2d(np.clip(np.sqrt(cert2), lo, hi), np.clip(np.sqrt(err2), lo, hi),
                             bins=[edges, edges])
    return h


def calibration_stats(results: pd.DataFrame | Mapping[str, CertifiedRows]
                      ) -> CalibrationStats:
    """:class:`CalibrationStats` of rows held in memory (a results table or
    :func:`certified_rows` of one); the report reduces the dataset to the same numbers without
    holding its rows (:func:`tracesim.analysis.calibration_stream.calibration_stats_of`)."""
    by_design = certified_rows(results) if isinstance(results, pd.DataFrame) else results
    by_design = {d: r for d, r in by_design.items() if r.cert2.size}
    pos = []
    for d in sorted(by_design):
        c_d, e_d = np.sqrt(by_design[d].cert2), np.sqrt(by_design[d].err2)
        pos += [c_d[c_d > 0], e_d[e_d > 0]]
    pos = np.concatenate(pos) if pos else np.empty(0)
    lo, hi = axis_limits(np.quantile(pos, AXIS_QUANTILES) if pos.size else None)
    designs = {}
    for d in sorted(by_design):
        g = by_design[d]
        c, e = np.sqrt(g.cert2), np.sqrt(g.err2)
        q = np.unique(np.quantile(c, DECILES))
        idx = decile_bins(c, q)
        med = tuple((float(np.median(c[idx == k])), float(np.median(e[idx == k])))
                    for k in range(len(q) - 1) if (idx == k).any())
        covered, defined = calibration_counts(g.cert2, g.err2)
        designs[d] = DesignCalibration(int(c.size), g.sequences, histogram(g.cert2, g.err2,
                                                                           lo, hi),
                                       med, float(np.median(e / c)), covered, defined)
    return CalibrationStats(float(lo), float(hi), designs)


def _stats(results) -> CalibrationStats:
    return results if isinstance(results, CalibrationStats) else calibration_stats(results)


def certificate_error_figure(results: pd.DataFrame | Mapping[str, CertifiedRows]
                             | CalibrationStats) -> tuple[bytes, str] | None:
    """Realised error |ô − o| against the certificate C = sqrt(tr V̂), log–log, with y = x.
    ``results``: a results table, :func:`certified_rows` of one, or their
    :class:`CalibrationStats`."""
    stats_ = _stats(results)
    if not stats_.designs:
        return None
    plt = pyplot()
    designs = sorted(stats_.designs)
    fig, axes = plt.subplots(1, len(designs), figsize=(4.4 * len(designs), 4.0), squeeze=False,
                             sharex=True, sharey=True)
    lo, hi, edges = stats_.lo, stats_.hi, stats_.edges
    ratios = []
    for ax, design in zip(axes[0], designs, strict=True):
        g = stats_.designs[design]
        h = g.hist
        ax.pcolormesh(edges, edges, np.ma.masked_equal(h.T, 0), cmap="Greys",
                      norm=_log_norm(h.max()))
        ax.plot([lo, hi], [lo, hi], "r-", lw=1, label="y = x")
        # Median realised error per certificate decile (rows with a positive certificate).
        if g.medians:
            mx, my = zip(*g.medians, strict=True)
            ax.plot(mx, np.clip(my, lo, hi), "o-", color="tab:blue", ms=4,
                    label="median per certificate decile")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("certificate C = sqrt(tr V̂) (value units)")
        ax.set_title(f"{design}: {g.rows} rows, {g.sequences} seq.", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
        ratios.append(f"{design} {g.ratio:.2f}")
    axes[0][0].set_ylabel("realised error |ô − o| (value units)")
    caption = ("Certificate against realised error, one point per certified (sequence, layer, "
               "head, query, configuration) row, log–log; grey shading counts rows (log "
               "scale), blue dots are medians per certificate decile, the red line is y = x. "
               "A calibrated certificate puts the medians slightly below the line (|e| is "
               "about C at the mean, the median of a norm is smaller). Median |e|/C: "
               + ", ".join(ratios) + ". Rows with a zero certificate (nothing sampled) are "
               "left out; errors outside the axes are drawn at the border.")
    return png_bytes(fig), caption


def _log_norm(vmax: float):
    from matplotlib.colors import LogNorm

    return LogNorm(vmin=1, vmax=max(vmax, 2))


def coverage_level_figure(results: pd.DataFrame | Mapping[str, CertifiedRows]
                          | CalibrationStats, head_dim: int | None = None
                          ) -> tuple[bytes, str] | None:
    """Empirical coverage of |e| <= z C across nominal levels (``calibration_curve``).
    ``results``: a results table, :func:`certified_rows` of one, or their
    :class:`CalibrationStats`."""
    stats_ = _stats(results)
    if not stats_.designs:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 4.2))
    levels = LEVELS
    d = int(head_dim) if head_dim else 64
    # A calibrated Gaussian error with tr V = C^2 covers with P(chi2_nu / nu <= z^2), where the
    # effective dof nu lies in [1, d]: nu = 1 is the diagonal, nu = d equal variances.
    z2 = stats.norm.ppf((1 + levels) / 2) ** 2
    ax.fill_between(levels, levels, stats.chi2.cdf(z2 * d, d), color="0.85",
                    label=f"calibrated, effective dof 1..{d}")
    ax.plot(levels, levels, "k--", lw=1, label="y = x (dof 1)")
    for design in sorted(stats_.designs):
        g = stats_.designs[design]
        if g.defined == 0:
            raise ValueError("standardized_error has no finite value")
        ax.plot(levels, g.covered / g.defined, lw=1.8, label=f"{design} ({g.sequences} seq.)")
    ax.set_xlabel("nominal level")
    ax.set_ylabel("share of rows with |e| <= z C")
    ax.set_xlim(0.5, 1.0)
    ax.set_ylim(0.0, 1.01)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("coverage against nominal level")
    caption = ("Coverage against nominal level: for each level, the share of certified rows "
               "whose realised error norm |e| lies within z_{(1+level)/2} times the "
               "certificate C (tracesim.analysis.coverage.calibration_curve of |e|/C). For a "
               "d-dimensional head output the calibrated curve depends on how the variance "
               "spreads over coordinates: the grey band runs from one dominant coordinate "
               f"(the diagonal) to {d} equal ones, the two extremes (other spreads fall close "
               "to it). A curve well below the band means the certificate is too small; well "
               "above it, conservative. Rows are not independent "
               "(one sequence gives many), so the curve has no interval; the C1 figure has "
               "cluster-robust ones.")
    return png_bytes(fig), caption


def accuracy_budget_figure(outcomes: pd.DataFrame) -> tuple[bytes, str] | None:
    """End-to-end accuracy against budget, one line per policy, with the full cache."""
    if outcomes.empty or "budget" not in outcomes:
        return None
    df = outcomes.copy()
    df["label"] = policy_labels(df)
    if "schedule" in df:
        sched = df["schedule"].astype(str)
        df.loc[sched != "oneshot", "label"] += " (" + sched[sched != "oneshot"] + ")"
    ev = df[df["score"] != "full"]
    ev = ev[pd.to_numeric(ev["budget"], errors="coerce").notna()]
    if ev.empty:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    n_seq = df["sequence_id"].nunique()
    groups = list(ev.groupby("label"))
    budgets = pd.to_numeric(ev["budget"]).to_numpy(float)
    # Policies often tie (accuracy moves in steps of 1/n): dodge them sideways to keep each
    # line visible; the dodge is a small share of the budget range.
    width = 0.012 * max(float(np.ptp(budgets)), 0.1)
    markers = "osD^vP*Xh<>"
    for i, (label, g) in enumerate(groups):
        per = g.groupby(["budget", "sequence_id"])["correct"].mean().groupby(level=0)
        m, s, k = per.mean(), per.std(ddof=1), per.size()
        err = (s / np.sqrt(k)).fillna(0).to_numpy() * 1.96
        x = m.index.to_numpy(float) + (i - (len(groups) - 1) / 2) * width
        y = m.to_numpy(float)
        yerr = np.vstack([np.minimum(err, y), np.minimum(err, 1 - y)])  # stay inside [0, 1]
        ax.errorbar(x, y, yerr=yerr, marker=markers[i % len(markers)],
                    capsize=3, label=label, alpha=0.85)
    full = df.drop_duplicates("sequence_id")["full_correct"].astype(float).mean() \
        if "full_correct" in df else np.nan
    if np.isfinite(full):
        ax.axhline(full, color="k", ls="--", lw=1, label=f"full cache ({full:.2f})")
    ax.set_xlabel("budget (fraction of the context)")
    ax.set_ylabel("accuracy (share correct)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("end-to-end accuracy against budget")
    caption = (f"End-to-end accuracy against budget per policy, from the in-loop outcomes "
               f"({n_seq} sequence{'s' if n_seq != 1 else ''}): mean over sequences of each "
               "sequence's share of correct answers (over seeds), with ±1.96 standard errors "
               "across sequences, cut at 0 and 1 (none with one sequence); the dashed line "
               "is the full cache on the same sequences. Points are dodged sideways so that "
               "tied policies stay visible. With few sequences the points move in steps of "
               "1/n.")
    return png_bytes(fig), caption


def heatmap_cells(results: pd.DataFrame, column: str) -> pd.DataFrame:
    """Per (design, layer, head) of the certified rows with a positive certificate, an error
    and a ``column`` value: ``coverage`` (mean of ``column``), ``sequences`` (distinct) and
    ``rows``; the report computes the same cells in DuckDB."""
    df = _certified(results, ["design", "cert2", "err2", "sequence_id", "layer", "head", column])
    if df.empty or column not in df:
        return pd.DataFrame(columns=["design", "layer", "head", "coverage", "sequences", "rows"])
    df = df[df[column].notna()]
    return (df.groupby(["design", "layer", "head"])
            .agg(coverage=(column, "mean"), sequences=("sequence_id", "nunique"),
                 rows=(column, "size")).reset_index())


def coverage_heatmap(results: pd.DataFrame, column: str, nominal: float,
                     min_clusters: int = MIN_CLUSTERS, *,
                     cells: pd.DataFrame | None = None) -> tuple[bytes, str] | None:
    """Coverage per (layer, query head), one panel per certified design, fixed diverging
    scale centred on nominal; cells with fewer than ``min_clusters`` sequences are masked.
    ``cells`` (:func:`heatmap_cells`' columns) replaces ``results`` when given."""
    cells = heatmap_cells(results, column) if cells is None else cells
    if cells.empty:
        return None
    from matplotlib.colors import TwoSlopeNorm

    plt = pyplot()
    designs = sorted(cells["design"].unique())
    layers = np.sort(cells["layer"].unique())
    heads = np.sort(cells["head"].unique())
    fig, axes = plt.subplots(1, len(designs), figsize=(0.5 + 0.35 * len(heads) * len(designs)
                                                      + 1.5 * len(designs),
                                                      1.2 + 0.16 * len(layers)),
                             squeeze=False)
    lo = 0.0
    norm = TwoSlopeNorm(vcenter=nominal, vmin=lo, vmax=1.0)
    cmap = plt.get_cmap("RdBu").with_extremes(bad="0.8")
    ns = []
    im = None
    for ax, design in zip(axes[0], designs, strict=True):
        g = cells[cells["design"] == design]
        cov = g.pivot(index="layer", columns="head", values="coverage")
        nseq = g.pivot(index="layer", columns="head", values="sequences")
        rows = g.pivot(index="layer", columns="head", values="rows")
        cov = cov.reindex(index=layers, columns=heads)
        nseq = nseq.reindex(index=layers, columns=heads).fillna(0)
        rows = rows.reindex(index=layers, columns=heads).fillna(0)
        masked = np.ma.masked_where(nseq.to_numpy() < min_clusters, cov.to_numpy(float))
        im = ax.imshow(masked, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
        ax.set_xticks(range(len(heads)), heads, fontsize=7)
        step = max(1, len(layers) // 10)
        ax.set_yticks(range(0, len(layers), step), layers[::step], fontsize=7)
        ax.set_xlabel("query head")
        ax.set_title(f"{design}", fontsize=9)
        r = rows.to_numpy()[rows.to_numpy() > 0]
        span = f"{int(r.min())}" if r.min() == r.max() else f"{int(r.min())}–{int(r.max())}"
        ns.append(f"{design}: {span} rows and "
                  f"{int(nseq.to_numpy().max())} sequences per cell, "
                  f"{int((nseq.to_numpy() < min_clusters).sum())} of {nseq.size} cells masked")
        if len(heads) * len(layers) <= 120:
            for (i, j), v in np.ndenumerate(rows.to_numpy()):
                ax.text(j, i, f"{int(v)}", ha="center", va="center", fontsize=5, color="0.2")
    axes[0][0].set_ylabel("layer")
    fig.colorbar(im, ax=list(axes[0]), label=f"coverage ({column}); nominal {nominal:g}",
                 shrink=0.9)
    caption = (f"Coverage per (layer, query head): mean of {column} over the certified rows "
               f"of each cell. The colour scale is fixed — white at the nominal {nominal:g}, "
               f"red below down to {lo:g}, blue above up to 1 — and the same in every panel, "
               "so a noisy small run shows pale colours rather than invented contrast. Cells "
               f"backed by fewer than {min_clusters} sequences are grey. " + "; ".join(ns)
               + ". Rows within a cell share sequences, so a single dark cell is weak "
               "evidence; look for whole layers or heads.")
    return png_bytes(fig), caption
