"""Helpers of the in-loop eviction tests (the ``tiny_store`` fixture is in ``conftest.py``)."""

from tracesim.capture.inloop.evict import prefill_sequence

from tracesim.store import open_store


def prefilled(tiny_store, index: int = 0):
    """(store, loaded model, sequence, meta, prompt length, prefill) of one stored sequence."""
    path, loaded = tiny_store
    store = open_store(path)
    seq = store[store.sequence_ids[index]]
    meta = seq.meta
    P = int(meta["prompt_length"])
    pre = prefill_sequence(loaded.model, list(meta["token_ids"])[:P],
                           question_start=int(meta["question_start"]), window=8,
                           scaling=store.model.scaling)
    return store, loaded, seq, meta, P, pre
