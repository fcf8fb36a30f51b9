"""Replay peers over a trace store: one row per (sequence, layer, query head, decode step, seed)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import numpy as np
import pyarrow as pa
from scipy import special

from tracesim.peers.base import Peer, StepInput

__all__ = ["PEERS_SCHEMA", "PEER_COLUMNS", "PEER_KEY_COLUMNS", "replay_peers", "step_inputs",
           "write_peers_dataset"]

#: Seconds without a progress line after which ``progress`` prints one per (peer, seed).
PROGRESS_EVERY_S = 10.0

#: Result columns (besides the keys ``sequence_id, task, layer, head, kv_head, query_position,
#: context_tokens, peer, config_id, seed``). NaN where a peer does not define one. The last four
#: are MagicPIG's: hash sets, rows its attentions read, and the replicate certificate (NaN
#: with one hash set; ``MagicPIG._replicate_row``).
PEER_COLUMNS = ("err2", "rel_err", "truth_norm", "cert2", "wald_cov", "hajek_err2",
                "tail_size", "n_eff", "kept_tokens", "sampled", "expected_sampled", "budget_b",
                "peer_bound_ok", "peer_den_ok", "replicates", "rows_read", "rep_cert2",
                "rep_cov")


def step_inputs(trace, head: int, qi: int) -> StepInput:
    """The :class:`StepInput` of stored query ``qi`` of ``head`` (float64, exact truth).

    What the layer holds at the step: ``[0, t]``, or the window ``(t - w, t]`` of a sliding
    layer; the logits are soft-capped when the layer is, and the truth divides by the head's
    sink term too (:func:`tracesim.attention_rule.attention_outputs`'s rule).
    """
    t = int(trace.query_positions[qi])
    g = head // trace.group_size
    lo = int(trace.window_start(t))
    keys, values = trace.keys[g, lo:t + 1], trace.values[g, lo:t + 1]
    q = trace.queries[head, qi]
    s = trace.logits(keys @ q)
    sink = trace.sink(head)
    top = float(s.max()) if sink is None else max(float(s.max()), sink)
    w = np.exp(s - top)
    den = w.sum() + (0.0 if sink is None else float(np.exp(sink - top)))
    truth = (w @ values) / den
    return StepInput(layer=trace.layer, head=head, kv_head=g, step=t,
                     prompt_length=trace.prompt_length, query=q, keys=keys, values=values,
                     scale=float(trace.scale), logits=s, truth=truth, start=lo,
                     softcap=trace.softcap, sink=sink)


def replay_peers(store, peers: Sequence[Peer], seeds: Iterable[int], *,
                 layers: Sequence[int] | None = None, sequences: Sequence[str] | None = None,
                 alpha: float = 0.05, progress: bool = False) -> pa.Table:
    """Every peer x seed on every decode query of the chosen layers and sequences.

    Deterministic peers (Quest) run once (seed 0). Memory: one layer of one sequence.
    """
    from tracesim.replay import load_layer
    from tracesim.replay.engine import evaluated_queries

    z = float(special.ndtri(1 - alpha / 2))
    seeds = [int(s) for s in seeds]
    rows: dict[str, list] = {k: [] for k in (
        "sequence_id", "task", "layer", "head", "kv_head", "query_position", "context_tokens",
        "peer", "config_id", "seed", *PEER_COLUMNS)}
    ids = list(sequences) if sequences is not None else [s.sequence_id for s in store]
    last = time.monotonic()
    for sid in ids:
        seq = store[sid]
        for layer in (layers if layers is not None else range(store.model.n_layers)):
            trace = load_layer(store, seq, int(layer))
            qidx = evaluated_queries(trace, ("decode",))
            for peer in peers:
                for seed in (seeds if peer.randomized else seeds[:1]):
                    states = {g: peer.prepare(trace.layer, g, trace.keys[g],
                                              trace.prompt_length, seed, trace.window)
                              for g in range(trace.n_kv_heads)}
                    for h in range(trace.n_heads):
                        for qi in qidx:
                            x = step_inputs(trace, h, int(qi))
                            r = peer.step(x, states[x.kv_head], seed, z)
                            norm = float(np.linalg.norm(x.truth))
                            r["truth_norm"] = norm
                            r["rel_err"] = float(np.sqrt(r["err2"]) / max(norm, 1e-300))
                            for k, v in (("sequence_id", sid), ("task", seq.meta.get("task")),
                                         ("layer", trace.layer), ("head", h),
                                         ("kv_head", x.kv_head), ("query_position", x.step),
                                         ("context_tokens", x.step + 1), ("peer", peer.name),
                                         ("config_id", peer.label()), ("seed", seed)):
                                rows[k].append(v)
                            for k in PEER_COLUMNS:
                                rows[k].append(float(r.get(k, np.nan)))
                    if progress and time.monotonic() - last > PROGRESS_EVERY_S:
                        # a long layer (a 128k store) says where it is between layer lines
                        print(f"  {sid} layer {layer}: {peer.label()} seed {seed} done",
                              flush=True)
                        last = time.monotonic()
            if progress:
                print(f"  {sid} layer {layer}: done", flush=True)
                last = time.monotonic()
    return pa.table(rows)


#: Arrow type of every peers column (fixed, so every part has the same schema).
PEERS_SCHEMA = pa.schema(
    [("sequence_id", pa.string()), ("task", pa.string()), ("layer", pa.int64()),
     ("head", pa.int64()), ("kv_head", pa.int64()), ("query_position", pa.int64()),
     ("context_tokens", pa.int64()), ("peer", pa.string()), ("config_id", pa.string()),
     ("seed", pa.int64())] + [(c, pa.float64()) for c in PEER_COLUMNS])
#: Columns that identify one peers row.
PEER_KEY_COLUMNS = ("sequence_id", "layer", "head", "query_position", "config_id", "seed")


def write_peers_dataset(out, store, peers: Sequence[Peer], seeds: int,
                        layers: Sequence[int] | None, *, run_doc: dict,
                        progress: bool = False, prereg: dict | None = None) -> int:
    """Replay ``peers`` into the results dataset ``OUT/results`` (:mod:`tracesim.dataset`):
    one part per sequence written as it finishes, in the store's order, ``peers.json``
    (labels, seeds, layers, rows) and the signed summary beside them; a rerun with the same
    ``run_doc`` keeps the parts already written. Returns the rows."""
    import json

    from tracesim.dataset import PartWriter, publish, run_id_of, schema_doc
    from tracesim.replay.results import store_identity

    run_id = run_id_of({**run_doc, "store": store_identity(store)})
    ids = [s.sequence_id for s in store]
    writer = PartWriter(out, run_id, PEERS_SCHEMA, width=max(5, len(str(len(ids) - 1))))
    entries = []
    for i, sid in enumerate(ids):
        key = f"peers/{sid}"
        entry = writer.finished(i, key)
        if entry is None:
            table = replay_peers(store, peers, range(seeds), layers=layers, sequences=[sid],
                                 progress=progress).cast(PEERS_SCHEMA)
            entry = writer.write(i, key, table.to_batches(), store=store.path.resolve().name,
                                 sequence_id=sid)
        if entry is not None:
            entries.append(entry)
    rows = sum(e["rows"] for e in entries)
    labels = [p.label() for p in peers]
    record = {"peers": labels, "seeds": seeds, "layers": None if layers is None
              else list(layers), "rows": rows}
    return publish(out, writer.build, entries, schema=schema_doc(PEERS_SCHEMA),
                   config_ids=labels, run={"run_id": run_id},
                   summary_doc=lambda r: {"store": str(store.path), **record, "prereg": prereg,
                                          **r},
                   key_columns=PEER_KEY_COLUMNS,
                   extra_files={"peers.json": json.dumps(record, indent=1).encode()})
