"""Claim C12's in-loop study: Conf-KV, its fixed twin at Conf-KV's realised mean kept tokens,
and the streaming baseline at the same tokens, over the sequences of a trace store.

The twin's budget depends on what Conf-KV realised over *all* the model's sequences, so the
study runs in two passes over prefills held in memory (one prefill per sequence, as
``tracesim evict`` would do per run): pass 1 decodes Conf-KV on every sequence; the fixed share
``f`` is then the one whose kept tokens equal Conf-KV's realised mean, ``f = mean kept / mean
population`` (population: the tokens of ``[lo, t)`` each layer holds at each step, pooled over
runs, layers and steps); pass 2 decodes the twin and the streaming baseline at ``f``.
The full cache's accuracy is the store's own (``full_correct``).

    python -m tracesim.capture.inloop.confkv_study run STORE --model M --out DIR [--limit N]
    python -m tracesim.capture.inloop.confkv_study merge OUT DIR1 DIR2 ...

``run`` writes ``DIR/rows.parquet`` (rows of ``tracesim evict``'s outcome schema, with
``model_id``); ``merge`` writes ``OUT/outcomes.parquet`` and its signed ``summary.json``, which
``tracesim report --outcomes OUT`` reads; sequence ids are prefixed by the model id so that two
models' rows stay distinct.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "merge", "run_c12"]


def run_c12(store_path: str | Path, model: str, out: str | Path, *, limit: int | None = None,
            max_new_tokens: int | None = None, confkv: Any = None, device: str = "cpu",
            progress: bool = True) -> dict[str, Any]:
    """Both passes over a store's sequences; returns the summary written beside the rows."""
    import pyarrow.parquet as pq
    from tracesim.capture.inloop.answer import sequence_answer
    from tracesim.capture.inloop.confkv import ConfKV
    from tracesim.capture.inloop.confkv_loop import ConfKVConfig, decode_confkv
    from tracesim.capture.inloop.evict import outcome_row, prefill_sequence
    from tracesim.capture.models import LoadedModel, load_model
    from tracesim.capture.runner import eos_token_ids

    from tracesim.columns import nullify_rows
    from tracesim.store import open_store

    store = open_store(store_path)
    loaded = model if isinstance(model, LoadedModel) else load_model(model, device)
    eos = set(eos_token_ids(loaded))
    base = confkv or ConfKV()
    ids = list(store.sequence_ids)[:limit]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    held, rows, kept, population = [], [], [], []

    def decode(meta: dict[str, Any], pre: Any, cfg: ConfKV) -> tuple[dict[str, Any], Any]:
        t0 = time.perf_counter()
        budget = max_new_tokens or len(meta["generated_ids"])
        res = decode_confkv(loaded.model, pre, cfg, budget, eos)
        row = outcome_row(meta, ConfKVConfig(cfg), -1, res, loaded.tokenizer,
                          store.model.n_layers)
        st = res.confkv_state
        row.update(decode_seconds=time.perf_counter() - t0, model_id=loaded.model_id,
                   confidence_mean=float(np.mean(st.confidences)) if st.confidences else None,
                   budget_share_mean=float(np.mean(st.shares)) if st.shares else None)
        return row, st

    for i, sid in enumerate(ids):
        meta = dict(store[sid].meta)
        meta["sequence_id"] = sid
        P = int(meta["prompt_length"])
        stored = {int(x) for x in meta["query_positions"] if int(x) < P}
        window = 0
        while P - 1 - window in stored:
            window += 1
        pre = prefill_sequence(loaded.model, list(meta["token_ids"])[:P],
                               question_start=int(meta["question_start"]),
                               window=max(window, 1), scaling=store.model.scaling,
                               layer_certificate=False)
        pre.answer = sequence_answer(meta, loaded.tokenizer)
        row, st = decode(meta, pre, base)
        rows.append(row)
        if st.step_kept:
            kept.append(np.stack(st.step_kept).sum())
            population.append(np.stack(st.step_population).sum())
        held.append((meta, pre))
        if progress:
            print(f"[pass 1] {i + 1}/{len(ids)} {sid} correct={row['correct']} kept="
                  f"{row['kept_tokens_mean']:.1f} {time.time() - start:.0f}s", flush=True)
    share = float(np.sum(kept) / np.sum(population))
    twins = [ConfKV("fixed", budget=round(share, 4), window=base.window, alpha=base.alpha,
                    ema=base.ema),
             ConfKV.streaming(round(share, 4), window=base.window)]
    for i, (meta, pre) in enumerate(held):
        for cfg in twins:
            rows.append(decode(meta, pre, cfg)[0])
        if progress:
            print(f"[pass 2] {i + 1}/{len(held)} {time.time() - start:.0f}s", flush=True)
    pq.write_table(nullify_rows(rows), out / "rows.parquet")
    summary = {"store": str(store_path), "model_id": loaded.model_id, "n_sequences": len(ids),
               "confkv": base.to_dict(), "matched_share": share,
               "configs": [base.label] + [c.label for c in twins],
               "wall_seconds": time.time() - start}
    (out / "study.json").write_text(json.dumps(summary, indent=2))
    return summary


def merge(out: str | Path, dirs: list[str | Path]) -> dict[str, Any]:
    """One signed outcomes directory from study directories (sequence ids prefixed by model)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from tracesim.atomic import atomic_files
    from tracesim.columns import describe_table
    from tracesim.integrity import results_record

    tables = []
    for d in dirs:
        t = pq.read_table(Path(d) / "rows.parquet")
        prefixed = pc.binary_join_element_wise(t["model_id"], t["sequence_id"], "/")
        tables.append(t.set_column(t.schema.get_field_index("sequence_id"), "sequence_id",
                                   prefixed))
    table = describe_table(pa.concat_tables(tables, promote_options="default"))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # every configuration is deterministic (seed null); like tracesim evict's summary, the seed
    # list names the one seed a randomized configuration would have used
    summary = {"studies": [str(d) for d in dirs], "n_rows": table.num_rows, "seeds": [0],
               "models": sorted(set(table["model_id"].to_pylist()))}
    with atomic_files(out, ["outcomes.parquet", "summary.json"]) as stage:
        pq.write_table(table, stage / "outcomes.parquet")
        summary.update(results_record(stage / "outcomes.parquet", table.num_rows,
                                      table["config_id"].unique().to_pylist()))
        (stage / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tracesim.capture.inloop.confkv_study")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("store")
    r.add_argument("--model", default="smollm2")
    r.add_argument("--out", required=True)
    r.add_argument("--limit", type=int, default=None)
    r.add_argument("--max-new-tokens", type=int, default=None)
    m = sub.add_parser("merge")
    m.add_argument("out")
    m.add_argument("dirs", nargs="+")
    args = p.parse_args(argv)
    if args.cmd == "run":
        print(json.dumps(run_c12(args.store, args.model, args.out, limit=args.limit,
                                 max_new_tokens=args.max_new_tokens), indent=2))
    else:
        print(json.dumps(merge(args.out, args.dirs), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
