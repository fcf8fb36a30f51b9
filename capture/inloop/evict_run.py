"""``tracesim evict``: in-loop eviction outcomes over the sequences of a trace store.

For each sequence of the store: one full-cache prefill, then one greedy decode per (policy, seed)
with the eviction enforced inside attention; one outcomes row per (sequence, policy, seed).
Results of a sequence are written to ``OUT/parts/<run key>/<sequence>.parquet`` atomically,
where the run key is a digest of everything that changes the rows (policies, seeds, model,
store, max_new_tokens, layer certificate): an interrupted run resumes at the first unfinished
sequence, and a rerun with another grid or seed count into the same ``OUT`` computes its own
rows instead of returning the old ones. ``OUT/outcomes.parquet`` and ``OUT/summary.json`` are
rewritten atomically at the end from the current run key's parts. The output directory is
locked for the run (a second concurrent ``evict`` on it exits 2).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tracesim.digests import prereg_record, safe_file_stem

__all__ = ["run_evict"]


# Letters and digits of any script are kept: the parts files of earlier runs keep their names,
# so a rerun resumes from them.
_UNSAFE_PART_CHARS = re.compile(r"[^\w.-]")


def _safe_name(sequence_id: str) -> str:
    """The parts file of a sequence (always digest-suffixed)."""
    return safe_file_stem(sequence_id, max_chars=80, digest_chars=12, unsafe=_UNSAFE_PART_CHARS,
                          always_digest=True) + ".parquet"


def _write_atomic(table: Any, path: Path) -> None:
    import pyarrow.parquet as pq

    from tracesim.atomic import atomic_output

    with atomic_output(path, unique=True) as fh:
        pq.write_table(table, fh)


def run_key(policies: Sequence[Any], seeds: Sequence[int], *, model_id: str, store: Any,
            max_new_tokens: int | None, layer_certificate: bool,
            fetch: Sequence[Any] | None = None, peers: Sequence[Any] | None = None,
            confkv: Sequence[Any] | None = None) -> str:
    """Digest of everything that determines the outcome rows (the resume key of a run)."""
    doc: dict[str, Any] = {"policies": [p.id for p in policies], "seeds": [int(s) for s in seeds],
           "model_id": model_id, "store_model": store.model.to_dict(),
           "max_new_tokens": max_new_tokens, "layer_certificate": bool(layer_certificate),
           "store_checksums": hashlib.sha256("\n".join(
               store.manifest.column("checksum").to_pylist()).encode()).hexdigest()}
    if fetch:  # runs without fetches keep their earlier keys
        doc["fetch"] = [{**f.row(), "memory": f.memory.to_dict()} for f in fetch]
    if peers:  # likewise runs without peers
        doc["peers"] = [p.label() for p in peers]
    if confkv:  # likewise runs without Conf-KV configurations
        doc["confkv"] = [c.label for c in confkv]
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def run_evict(
    store_path: str | Path,
    policies: Sequence[Any],
    *,
    seeds: int | Sequence[int] = 4,
    out: str | Path = "outcomes",
    model: Any = "smollm2",
    sequences: Sequence[str] | None = None,
    max_new_tokens: int | None = None,
    layer_certificate: bool = True,
    progress: bool = True,
    device: str = "cpu",
    fetch: Sequence[Any] | None = None,
    peers: Sequence[Any] | None = None,
    confkv: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """Run every policy and seed in the loop over a store's sequences; return the summary.

    Parameters
    ----------
    store_path : path
        A trace store (its token ids, prompt boundaries, gold answers and full-cache outcome are
        used; tensors are not).
    policies : sequence of tracesim.policies.Policy
        One-shot or decode-time policies (see :func:`tracesim.policies.grid.parse_grid` for the
        YAML grammar).
    seeds : int or sequence of int
        Seeds for randomized policies (deterministic ones run once, seed -1).
    out : path
        Output directory.
    model : str or LoadedModel
        ``"smollm2"``, a local checkpoint directory, or a loaded model matching the store.
    max_new_tokens : int, optional
        Default: the full-cache run's number of generated tokens.
    layer_certificate : bool
        Also compute the per-layer output-space certificate at every decode step.
    fetch : sequence of tracesim.capture.inloop.fetch.FetchConfig, optional
        In-loop fetch configurations (scheduler, byte budget, memory model): every evicting
        policy and seed runs once per configuration, fetching evicted pages at every decode
        step and layer (docs/tiers.md, "In the loop"); policies that evict nothing run once,
        with null fetch columns. Needs one-shot policies.
    peers : sequence of tracesim.peers.Peer, optional
        Peers run in the loop besides the policies, each with its own estimator at every
        decode step (:mod:`tracesim.capture.inloop.peers`); randomized ones once per seed.
    confkv : sequence of tracesim.capture.inloop.confkv.ConfKV, optional
        Conf-KV family configurations run in the loop besides the policies, each once
        (:mod:`tracesim.capture.inloop.confkv_loop`).
    """
    import pyarrow.parquet as pq
    from tracesim.capture.models import LoadedModel, load_model, model_info

    from tracesim.atomic import DirLock, atomic_files, remove_stale_tmp
    from tracesim.errors import check_int, check_out_dir
    from tracesim.integrity import results_record
    from tracesim.store import open_store

    check_int(max_new_tokens, "max_new_tokens", 1, 1 << 20)
    if isinstance(seeds, int):
        check_int(seeds, "seeds", 1, 100_000)
    from tracesim.outpaths import check_output

    policies = list(policies)
    per_head = [p.id for p in policies if p.score.per_query_head]
    if per_head:
        # The loop enforces one kept set per KV head (its attention bias is per KV head).
        raise ValueError(f"gqa: policy {per_head[0]} draws one sample per query head (gqa = "
                         "'head'), which only the replay simulates; in-loop eviction expects "
                         "gqa 'mean' or 'max'")
    out = check_out_dir(check_output(out, [("trace store", store_path)]))
    store = open_store(store_path)
    if store.is_subset:
        raise ValueError(f"{store_path}: the store holds a subset of the model's layers/heads "
                         "(model.json field 'kept'); in-loop eviction needs a store of the "
                         "whole model")
    loaded = model if isinstance(model, LoadedModel) else load_model(model, device)
    info = model_info(loaded.model)
    for key in ("n_layers", "n_heads", "n_kv_heads", "head_dim"):
        if info[key] != getattr(store.model, key):
            raise ValueError(f"{store_path}: the store's model has {key} = "
                             f"{getattr(store.model, key)} but the loaded model has {info[key]}")
    from tracesim.capture.inloop.evict import check_inloop_variants
    from tracesim.capture.variants import attention_variants

    # Before any prefill: what the loop cannot enforce on this model's attention variants.
    for policy in policies:
        for fetch_cfg in (list(fetch) if fetch else [None]):
            check_inloop_variants(loaded.model, policy, {}, fetch_cfg)
    if peers and any(v is not None for v in attention_variants(loaded.model).values()):
        raise ValueError("in-loop peers on a model with sliding windows, a soft-cap or sinks are "
                         "not implemented; run the peers in the replay")
    seed_list = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
    if not seed_list:
        raise ValueError("seeds: expected at least one seed")
    fetch = list(fetch) if fetch else None
    if fetch:
        _check_fetch(policies, fetch)
    ids = list(store.sequence_ids) if sequences is None else list(sequences)
    missing = [s for s in ids if s not in store]
    if missing:
        raise ValueError(f"{store_path}: sequences {missing[:5]} are not in the store")
    out.mkdir(parents=True, exist_ok=True)
    lock = DirLock(out, "evict")
    try:
        key = run_key(policies, seed_list, model_id=loaded.model_id, store=store,
                      max_new_tokens=max_new_tokens, layer_certificate=layer_certificate,
                      fetch=fetch, peers=peers, confkv=confkv)
        parts = out / "parts" / key
        parts.mkdir(parents=True, exist_ok=True)
        # The lock is held: temporary files here belong to killed runs on this directory.
        remove_stale_tmp(out)
        remove_stale_tmp(out / "parts", recursive=True)
        table, summary = _run_locked(store, store_path, loaded, policies, seed_list, ids, out,
                                     parts, key, max_new_tokens, layer_certificate, progress,
                                     fetch, peers, confkv)
        # The outcomes and the summary that signs them (rows, sha256, configurations) are one
        # unit: the report refuses outcomes that do not match their summary.
        with atomic_files(out, ["outcomes.parquet", "summary.json"]) as stage:
            pq.write_table(table, stage / "outcomes.parquet")
            ids_run = table["config_id"].unique().to_pylist() if table.num_rows else []
            summary.update(results_record(stage / "outcomes.parquet", table.num_rows, ids_run))
            (stage / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
    finally:
        lock.release()


def _check_fetch(policies: Sequence[Any], fetch: Sequence[Any]) -> None:
    """In-loop fetches need one-shot policies; certificate schedulers certified ones."""
    for p in policies:
        if p.score.evicts and p.schedule.kind != "oneshot":
            raise ValueError(f"--fetch: policy {p.id} uses schedule {p.schedule.kind}; in-loop "
                             "fetches are modelled for one-shot eviction only")
        cert = sorted({f.scheduler for f in fetch if f.scheduler.startswith("certificate")})
        if cert and p.score.evicts and not p.certified:
            raise ValueError(f"--fetch {','.join(cert)}: needs certified base policies "
                             f"(randomized design with the Hajek correction); {p.id} is not")


def _run_locked(store, store_path, loaded, policies, seed_list, ids, out, parts, key,
                max_new_tokens, layer_certificate, progress, fetch=None, peers=None,
                confkv=None) -> dict[str, Any]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm.auto import tqdm
    from tracesim.capture.inloop.answer import sequence_answer
    from tracesim.capture.inloop.evict import (
        decode_policy,
        layer_plans,
        outcome_row,
        prefill_sequence,
    )
    from tracesim.capture.runner import eos_token_ids

    from tracesim.columns import describe_table, nullify_rows

    eos = set(eos_token_ids(loaded))
    runs = [(p, s, f) for p in policies for s in (seed_list if p.needs_seeds else [-1])
            for f in (fetch if fetch and p.score.evicts else [None])]
    if peers:
        from tracesim.capture.inloop.peers import PeerConfig

        runs += [(PeerConfig(q), s, None) for q in peers
                 for s in (seed_list if q.randomized else [-1])]
    if confkv:
        from tracesim.capture.inloop.confkv_loop import ConfKVConfig

        runs += [(ConfKVConfig(c), -1, None) for c in confkv]
    start = time.time()
    done = skipped = 0
    bar = tqdm(total=len(ids) * len(runs), desc="evict", unit="run", disable=not progress)
    for sid in ids:
        target = parts / _safe_name(sid)
        if target.exists():
            skipped += 1
            bar.update(len(runs))
            continue
        seq = store[sid]
        meta = dict(seq.meta)
        meta["sequence_id"] = sid
        P = int(meta["prompt_length"])
        # The store's own capture window: a SnapKV window longer than the default 32 (the
        # SnapKVPress alias reads 64) needs the prefill to record that many queries again.
        # (the run of stored query positions ending at the prompt's last position)
        stored = {int(x) for x in meta["query_positions"] if int(x) < P}
        window = 0
        while P - 1 - window in stored:
            window += 1
        window = max(window, 1)
        pre = prefill_sequence(loaded.model, list(meta["token_ids"])[:P],
                               question_start=int(meta["question_start"]), window=window,
                               scaling=store.model.scaling, layer_certificate=layer_certificate)
        pre.answer = sequence_answer(meta, loaded.tokenizer)  # None: null answer columns
        budget = max_new_tokens or len(meta["generated_ids"])
        rows = []
        for policy, seed, fc in runs:
            t0 = time.perf_counter()
            # a peer, with its own estimator (tracesim.capture.inloop.peers)
            if hasattr(policy, "confkv"):
                from tracesim.capture.inloop.confkv_loop import decode_confkv

                res = decode_confkv(loaded.model, pre, policy.confkv, budget, eos)
                row = outcome_row(meta, policy, seed, res, loaded.tokenizer, store.model.n_layers)
            elif hasattr(policy, "peer"):
                from tracesim.capture.inloop.peers import decode_peer, peer_step_columns

                res = decode_peer(loaded.model, pre, policy.peer, budget, eos, max(seed, 0))
                row = outcome_row(meta, policy, seed, res, loaded.tokenizer, store.model.n_layers)
                row.update(peer_step_columns(policy.peer, res, P, store.model.head_dim))
            else:
                plans = layer_plans(pre.traces, policy, max(seed, 0))
                res = decode_policy(loaded.model, pre, plans, budget, eos, policy,
                                    max(seed, 0), fetch=fc)
                row = outcome_row(meta, policy, seed, res, loaded.tokenizer,
                                  store.model.n_layers, n_kv=store.model.n_kv_heads,
                                  head_dim=store.model.head_dim)
            if fetch:
                from tracesim.capture.inloop.fetch import fetch_columns

                row.update(fetch_columns(fc, res.fetch_log))
            row["decode_seconds"] = time.perf_counter() - t0
            row["model_id"] = loaded.model_id
            rows.append(row)
            bar.update(1)
        _write_atomic(nullify_rows(rows), target)
        done += 1
    bar.close()
    tables = [pq.read_table(parts / _safe_name(sid)) for sid in ids]
    table = (describe_table(pa.concat_tables(tables, promote_options="default")) if tables
             else pa.table({}))
    summary = {
        "store": str(store_path), "model_id": loaded.model_id, "n_sequences": len(ids),
        "sequences_written": done, "sequences_skipped": skipped, "n_rows": table.num_rows,
        "policies": ([p.id for p in policies] + [p.label() for p in peers or []]
                     + [c.label for c in confkv or []]),
        "seeds": seed_list, "run_key": key,
        "wall_seconds": time.time() - start,
    }
    prereg = prereg_record(None, str(store_path))
    if prereg is not None:
        summary["prereg"] = prereg
    if table.num_rows:
        df = table.select(["config_id", "correct", "full_correct"]).to_pandas()
        if fetch:  # the configurations as they run without fetching (scheduler none or null)
            sched = table.column("fetch_scheduler").to_pandas()
            df = df[sched.isna() | (sched == "none")]
        summary["accuracy"] = {k: float(np.mean(v)) for k, v in
                               df.groupby("config_id")["correct"]}
    if fetch and table.num_rows:
        df = table.select(["config_id", "fetch_scheduler", "fetch_budget", "correct",
                           "fetch_bytes_share"]).to_pandas()
        summary["fetch"] = {"configs": [{**f.row()} for f in fetch],
                            "memory": fetch[0].memory.to_dict(), "accuracy": [
            {"config_id": c, "fetch_scheduler": s, "fetch_budget": b,
             "accuracy": float(g.correct.mean()), "n": int(len(g)),
             "bytes_share": float(g.fetch_bytes_share.mean())}
            for (c, s, b), g in df.dropna(subset=["fetch_scheduler"]).groupby(
                ["config_id", "fetch_scheduler", "fetch_budget"])]}
    return table, summary
