"""Where a report's numbers come from, and how much they can bear.

:func:`collect_provenance` gathers the model, tasks, sequences, prompt lengths, seeds, layers,
configurations, tracesim version and the pre-registration hash from the results, the outcomes,
their ``summary.json`` files and (optionally) the trace store. :func:`sample_size_caveat` turns
the number of independent units — sequences, since every analysis clusters or averages by
sequence — into a tier and a sentence the report prints at the top.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

__all__ = ["SAMPLE_TIERS", "Provenance", "collect_provenance", "sample_size_caveat",
           "summary_head_dim"]

#: (smallest n, tier, what the numbers can support). n counts sequences: the independent units.
SAMPLE_TIERS: tuple[tuple[int, str, str], ...] = (
    (0, "a smoke test",
     "it shows the pipeline runs end to end; intervals rest on too few clusters to be trusted "
     "and no verdict should be cited"),
    (10, "a pilot",
     "effects are indicative only; cluster-robust intervals with fewer than 30 clusters are "
     "anti-conservative and per-stratum verdicts are underpowered"),
    (30, "a small study",
     "overall verdicts are usable; per-budget and per-stratum breakdowns remain exploratory"),
    (100, "a study", "intervals and verdicts are supported by the sample size"),
)


def sample_size_caveat(n: int) -> tuple[str, str]:
    """``(tier, sentence)`` for ``n`` independent sequences, e.g. ``n = 9 sequences: a smoke
    test — ...``. Tiers: < 10 smoke test, 10–29 pilot, 30–99 small study, >= 100 study."""
    n = int(n)
    tier, meaning = SAMPLE_TIERS[0][1:]
    for lower, name, text in SAMPLE_TIERS:
        if n >= lower:
            tier, meaning = name, text
    unit = "sequence" if n == 1 else "sequences"
    return tier, f"n = {n} {unit}: {tier} — {meaning}."


@dataclass
class Provenance:
    """The report's header: one ``(field, value)`` row each, plus the sample size."""

    rows: list[tuple[str, str]] = field(default_factory=list)
    n_sequences: int = 0
    tier: str = ""
    caveat: str = ""
    head_dim: int | None = None


def _span(values: pd.Series) -> str:
    v = pd.to_numeric(values, errors="coerce").dropna()
    if v.empty:
        return "unknown"
    lo, med, hi = int(v.min()), int(v.median()), int(v.max())
    return f"{lo} tokens" if lo == hi else f"{lo}–{hi} tokens (median {med})"


def _store_model(path: str | Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    f = Path(path) / "model.json"
    try:
        from tracesim.safeio import read_json

        return read_json(f, "store model.json", limit=1 << 20) if f.is_file() else None
    except (OSError, ValueError):
        return None


def _summary_stores(summary: dict[str, Any] | None) -> list[Any]:
    """The store paths a results summary names (a sweep's ``stores``, a replay's ``store``)."""
    if not summary:
        return []
    stores = [s.get("path") for s in summary.get("stores", []) if isinstance(s, dict)]
    return [*stores, summary.get("store")]


def summary_head_dim(summary: dict[str, Any] | None) -> int | None:
    """The head dimension of the model whose store a results summary names (None: no store
    found), for the cost columns of a results input other than the first."""
    for s in _summary_stores(summary):
        model = _store_model(s)
        if model and model.get("head_dim"):
            return int(model["head_dim"])
    return None


def _seeds(summary: dict[str, Any] | None, df: pd.DataFrame, column: str) -> str | None:
    s = (summary or {}).get("seeds")
    if isinstance(s, list) and s:
        return f"{len(s)} ({s[0]}..{s[-1]})" if len(s) > 3 else ", ".join(map(str, s))
    if isinstance(s, int):
        return str(s)
    if column in df and not df.empty:
        largest = pd.to_numeric(df[column], errors="coerce").max()
        return None if pd.isna(largest) else str(int(largest))  # all null: deterministic
    return None


def _result_facts(results) -> dict[str, Any]:
    """What the header says of the results, from a DataFrame or, in a few group-bys, from a
    :class:`~tracesim.analysis.aggregate.ResultsDataset`: one row per sequence (its task and
    prompt length), the layers, the number of configurations and the largest ``n_seeds``."""
    if results is None:
        results = pd.DataFrame()
    if isinstance(results, pd.DataFrame):
        per = [c for c in ("sequence_id", "task", "prompt_length") if c in results]
        seq = (results.drop_duplicates("sequence_id")[per] if "sequence_id" in results
               else pd.DataFrame())
        return {"per_sequence": seq,
                "layers": (sorted(results["layer"].unique())
                           if "layer" in results and not results.empty else []),
                "configs": (results["config_id"].nunique() if "config_id" in results
                            else None),
                "seeds": results[["n_seeds"]] if "n_seeds" in results else pd.DataFrame()}
    from tracesim.analysis.aggregate import quote

    ds = results
    if ds.empty:
        return _result_facts(pd.DataFrame(columns=list(ds.columns)))
    per = [c for c in ("task", "prompt_length") if c in ds]
    seq = (ds.query("SELECT \"sequence_id\"" + "".join(f", any_value({quote(c)}) AS {quote(c)}"
                                                       for c in per)
                    + " FROM results GROUP BY \"sequence_id\"")
           if "sequence_id" in ds else pd.DataFrame())
    layers = (sorted(ds.query("SELECT DISTINCT \"layer\" FROM results WHERE \"layer\" IS NOT "
                              "NULL")["layer"].tolist()) if "layer" in ds else [])
    configs = (int(ds.query("SELECT count(DISTINCT \"config_id\") AS n FROM results")["n"][0])
               if "config_id" in ds else None)
    seeds = (ds.query("SELECT max(\"n_seeds\") AS n_seeds FROM results") if "n_seeds" in ds
             else pd.DataFrame())
    return {"per_sequence": seq, "layers": layers, "configs": configs, "seeds": seeds}


def collect_provenance(results: Any, summary_r: dict[str, Any] | None,
                       outcomes: pd.DataFrame | None, summary_o: dict[str, Any] | None, *,
                       prereg_sha256: str, prereg_name: str, prereg_matches: bool,
                       traces_dir: str | Path | None = None,
                       results_inputs: Sequence[tuple[str, int, str]] = ()) -> Provenance:
    """Build the provenance header from whatever inputs the report was given;
    ``results_inputs`` are the results directories as ``(label, rows, sha256)``, the first
    the one the claims read."""
    from tracesim.version import __version__

    facts = _result_facts(results)
    res = facts.pop("per_sequence")
    out = outcomes if outcomes is not None else pd.DataFrame()
    stores = _summary_stores(summary_r)
    if summary_o:
        stores.append(summary_o.get("store"))
    model = _store_model(traces_dir)
    for s in stores:
        model = model or _store_model(s)
    model_id = (model or {}).get("model_id") or (summary_o or {}).get("model_id")
    prov = Provenance()
    rows = prov.rows
    if model:
        m = {k: model.get(k, "?") for k in ("architecture", "n_layers", "n_heads", "n_kv_heads",
                                             "head_dim", "dtype")}
        rows.append(("model", f"{model_id} ({m['architecture']}, {m['n_layers']} layers, "
                              f"{m['n_heads']} heads / {m['n_kv_heads']} KV heads, head_dim "
                              f"{m['head_dim']}, traces in {m['dtype']})"))
        prov.head_dim = int(model["head_dim"]) if model.get("head_dim") else None
    else:
        rows.append(("model", model_id or "unknown (give --traces to name it)"))
    seq_ids: set[str] = set()
    for df in (res, out):
        if "sequence_id" in df:
            seq_ids |= set(df["sequence_id"].astype(str))
    frames = [d[["sequence_id", "task"]] for d in (res, out)
              if {"sequence_id", "task"} <= set(d.columns)]
    tasks = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if not tasks.empty:
        per = tasks.drop_duplicates("sequence_id")["task"].value_counts().sort_index()
        rows.append(("tasks", ", ".join(f"{t} ({n})" for t, n in per.items())))
    else:
        rows.append(("tasks", "unknown"))
    parts = []
    if "sequence_id" in res:
        parts.append(f"{res['sequence_id'].nunique()} in the replay results")
    if "sequence_id" in out:
        parts.append(f"{out['sequence_id'].nunique()} in the in-loop outcomes")
    rows.append(("sequences", f"{len(seq_ids)}" + (f" ({'; '.join(parts)})" if parts else "")))
    if "prompt_length" in res:
        lengths = res.drop_duplicates("sequence_id")["prompt_length"]
        rows.append(("prompt lengths", _span(lengths)))
    layers = facts["layers"]
    if layers:
        rows.append(("layers replayed", f"{len(layers)} ({layers[0]}..{layers[-1]})"))
    if facts["configs"] is not None:
        rows.append(("configurations", f"{facts['configs']} replayed"
                     + (f", {out['config_id'].nunique()} in the loop"
                        if "config_id" in out else "")))
    seeds = [f"replay {s}" for s in [_seeds(summary_r, facts["seeds"], "n_seeds")] if s]
    seeds += [f"in-loop {s}" for s in [_seeds(summary_o, out, "seed")] if s and not out.empty]
    rows.append(("seeds", "; ".join(seeds) or "unknown"))
    produced = (summary_r or {}).get("version")
    rows.append(("tracesim version", f"{__version__} (report)" + (
        f", {produced} (results)" if produced and produced != __version__ else "")))
    for i, (label, n_rows, sha) in enumerate(results_inputs):
        rows.append(("results (the claims read it)" if i == 0 else "results (descriptive)",
                     f"{label}: {n_rows:,} rows, {sha}"))
    rows.append(("pre-registration", f"{prereg_name} {prereg_sha256}"
                 + ("" if prereg_matches else " — CHANGED after the results were produced")))
    n_units = [d["sequence_id"].nunique() for d in (res, out) if "sequence_id" in d]
    prov.n_sequences = int(min(n_units)) if n_units else 0
    prov.tier, prov.caveat = sample_size_caveat(prov.n_sequences)
    if len(n_units) == 2 and n_units[0] != n_units[1]:
        prov.caveat += (f" (The smaller of the two inputs counts: {n_units[0]} replayed and "
                        f"{n_units[1]} in-loop sequences.)")
    return prov

