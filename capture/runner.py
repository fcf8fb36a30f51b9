"""Capture runs: tasks -> greedy generation with recording -> a trace store.

A run is a list of ``(task, index)`` instances with deterministic sequence ids; sequences the
store already holds are skipped, so an interrupted run resumes where it stopped and ends with the
same store as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tracesim.capture.attention import CaptureState, LayerArrays, recording
from tracesim.capture.generate import greedy_generate
from tracesim.capture.models import LoadedModel, load_model, model_info, o_proj_weights, rope_info
from tracesim.capture.prompts import PromptSpec, grade_answer, render_prompt
from tracesim.capture.tasks import TASKS, TaskPrompt, build_prompt, grade, instance_seed
from tracesim.capture.variants import attention_variants, subset_variants

#: Query roles in precedence order (a position in several windows takes the first).
ROLES = ("context_window", "question_window", "decode", "all")


@dataclass(frozen=True)
class CaptureConfig:
    """What to record.

    Attributes
    ----------
    window : int
        SnapKV observation window length w (context and question windows).
    all_positions : bool
        Record Q and outputs at every position, not only the windows and decode steps.
    max_new_tokens : int, optional
        Generation budget; None uses each task's own.
    prefill_chunk : int
        Prompt tokens per prefill forward.
    h2o_chunk : int
        Queries per chunk when accumulating H2O statistics.
    """

    window: int = 32
    all_positions: bool = False
    max_new_tokens: int | None = None
    prefill_chunk: int = 2048
    h2o_chunk: int = 256


def query_roles(
    prompt_length: int, question_start: int, n_positions: int, window: int, all_positions: bool
) -> tuple[list[int], list[str]]:
    """Recorded query positions (sorted) and their roles, as the trace manifest lists them.

    ``context_window`` = ``[question_start - w, question_start)``, ``question_window`` =
    ``[prompt_length - w, prompt_length)``, ``decode`` = ``[prompt_length, n_positions)`` and, with
    ``all_positions``, ``all`` for every other position.
    """
    windows = (
        range(max(0, question_start - window), question_start),
        range(max(0, prompt_length - window), prompt_length),
        range(prompt_length, n_positions),
        range(0, n_positions if all_positions else 0),
    )
    roles: dict[int, str] = {}
    for role, positions in zip(ROLES, windows, strict=True):
        for p in positions:
            roles.setdefault(p, role)
    ordered = sorted(roles)
    return ordered, [roles[p] for p in ordered]


def sequence_id(task: str, length: int, seed: int, index: int) -> str:
    """Deterministic id of the ``index``-th instance of ``task`` in a run."""
    return f"{task}-L{length}-s{seed}-{index:04d}"


def capture_prompt(
    loaded: LoadedModel, prompt: TaskPrompt, config: CaptureConfig = CaptureConfig(),
    layers: Sequence[int] | None = None,
) -> tuple[dict[str, Any], list[LayerArrays]]:
    """Run one prompt with recording (of every layer, or of ``layers`` only).

    Returns
    -------
    row : dict
        Manifest fields of the sequence (all but ``sequence_id`` and those the store derives).
    layers : list of LayerArrays
        Per-layer float32 arrays (keys/values ``(H_kv, n_positions, D)``, queries/outputs
        ``(H, n_query, D)``, h2o ``(H, n_positions)``).
    """
    model, tok = loaded.model, loaded.tokenizer
    p = prompt
    pre_positions, _ = query_roles(
        p.prompt_length, p.question_start, p.prompt_length, config.window, config.all_positions
    )
    state = CaptureState(
        p.prompt_length,
        pre_positions,
        record_all=config.all_positions,
        record_from=p.prompt_length,
        h2o_chunk=config.h2o_chunk,
        layers=layers,
    )
    eos = eos_token_ids(loaded)
    budget = config.max_new_tokens or p.max_new_tokens
    with recording(model, state):
        gen = greedy_generate(
            model, p.token_ids, budget, eos, state=state, prefill_chunk=config.prefill_chunk
        )
    layers = state.finalize()
    n_positions = len(gen.fed_ids)
    positions, roles = query_roles(
        p.prompt_length, p.question_start, n_positions, config.window, config.all_positions
    )
    for layer, arrays in enumerate(layers):
        if arrays.positions.tolist() != positions or arrays.keys.shape[1] != n_positions:
            raise RuntimeError(f"layer {layer} recorded positions that disagree with the plan")
    answer_ids = gen.generated_ids[:-1] if gen.stopped_on_eos else gen.generated_ids
    answer = tok.decode(answer_ids, skip_special_tokens=True) if tok is not None else ""
    gold: str | None = p.gold
    if "grader" in p.meta:  # a prompt of the user's own (tracesim.capture.prompts)
        gold = p.gold if p.meta.get("has_answer") else None
        correct = grade_answer(p.meta["grader"], answer, gold)
    else:
        correct = grade(p.task, answer, p.gold)
    row = dict(
        task=p.task,
        seed=p.seed,
        length=p.length,
        token_ids=gen.fed_ids,
        prompt_length=p.prompt_length,
        context_start=p.context_start,
        context_end=p.context_end,
        question_start=p.question_start,
        question_end=p.question_end,
        generated_ids=gen.generated_ids,
        generated_logprobs=gen.logprobs,
        answer=answer,
        gold=gold,
        correct=correct,
        query_positions=positions,
        query_roles=roles,
        n_positions=n_positions,
        n_query=len(positions),
    )
    return row, layers


def eos_token_ids(loaded: LoadedModel) -> list[int]:
    """End-of-sequence token ids of a loaded model (generation config and tokenizer)."""
    ids: set[int] = set()
    for source in (getattr(loaded.model, "generation_config", None), loaded.tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    return sorted(ids)


def model_meta(loaded: LoadedModel, storage_dtype: str) -> Any:
    """The store's ``ModelMeta`` for a loaded model and a storage dtype."""
    from tracesim.store import ModelMeta

    return ModelMeta(model_id=loaded.model_id, dtype=storage_dtype, **model_info(loaded.model),
                     **rope_info(loaded.model), **attention_variants(loaded.model))


def subset_rope(rope: dict[str, Any], layers: Sequence[int]) -> dict[str, Any]:
    """:func:`rope_info` of the stored ``layers`` (``layer_rope`` is one entry per layer)."""
    if rope.get("layer_rope") is None:
        return rope
    return {**rope, "layer_rope": [rope["layer_rope"][i] for i in layers]}


@dataclass(frozen=True)
class Subset:
    """Which layers and KV heads a capture stores (each KV head with its GQA group).

    Attributes
    ----------
    layers, kv_heads, heads : list of int
        Model indices, increasing; ``heads`` are the query heads of ``kv_heads``.
    meta : ModelMeta
        The stored shape (``n_layers = len(layers)`` etc.).
    kept : dict or None
        ``model.json``'s ``kept`` entry; None when everything is kept.
    """

    layers: list[int]
    kv_heads: list[int]
    heads: list[int]
    meta: Any
    kept: dict[str, Any] | None


def model_subset(loaded: LoadedModel, storage_dtype: str, layers: Sequence[int] | None = None,
                 kv_heads: Sequence[int] | None = None) -> Subset:
    """Validate a layer / KV-head subset against the model and build the stored shape.

    Raises
    ------
    ValueError
        Naming the option and the valid range when an index is out of range or repeated.
    """
    from tracesim.store import ModelMeta
    from tracesim.store.format import kept_entry

    info = model_info(loaded.model)
    L, H, K = info["n_layers"], info["n_heads"], info["n_kv_heads"]
    chosen = []
    for opt, given, n in (("--layers", layers, L), ("--heads", kv_heads, K)):
        idx = list(range(n)) if given is None else [int(x) for x in given]
        if not idx or len(set(idx)) != len(idx) or min(idx) < 0 or max(idx) >= n:
            raise ValueError(f"{opt} is {given}, expected distinct indices in [0, {n})")
        chosen.append(sorted(idx))
    lay, kvh = chosen
    kept = kept_entry(lay, kvh, L, H, K)
    full = lay == list(range(L)) and kvh == list(range(K))
    meta = ModelMeta(model_id=loaded.model_id, dtype=storage_dtype,
                     **{**info, "n_layers": len(lay), "n_kv_heads": len(kvh),
                        "n_heads": len(kept["heads"])}, **subset_rope(rope_info(loaded.model), lay),
                     **subset_variants(attention_variants(loaded.model), lay, kept["heads"]))
    return Subset(lay, kvh, kept["heads"], meta, None if full else kept)


@dataclass
class CaptureSummary:
    """What :func:`run_capture` did."""

    written: list[str]
    skipped: list[str]
    correct: dict[str, list[bool]]


def run_capture(
    model: str | LoadedModel = "smollm2",
    tasks: Sequence[str] = ("passkey",),
    n: int = 16,
    length: int = 1024,
    out: str | Path = "traces",
    *,
    storage_dtype: str = "float16",
    device: str = "cpu",
    compute_dtype: str | None = None,
    seed: int = 0,
    depth: float | None = None,
    config: CaptureConfig = CaptureConfig(),
    store_o_proj: bool = True,
    progress: bool = True,
    on_sequence: Callable[[str, dict[str, Any]], None] | None = None,
    prompts: Sequence[PromptSpec] | None = None,
    layers: Sequence[int] | None = None,
    kv_heads: Sequence[int] | None = None,
    chat_template: bool = True,
) -> CaptureSummary:
    """Capture ``n`` instances of each task, or your own ``prompts``, into the trace store at
    ``out`` (resumable).

    Parameters
    ----------
    model : str or LoadedModel
        ``"smollm2"``, a local checkpoint directory, or an already loaded model.
    tasks : sequence of str
        Task names from :data:`tracesim.capture.tasks.TASKS` (ignored with ``prompts``).
    n, length, seed : int
        Instances per task, target prompt length in tokens, and the run seed. Instance ``i`` of
        task ``t`` has id ``sequence_id(t, length, seed, i)`` and instance seed
        ``instance_seed(t, length, seed, i)``.
    out : str or Path
        Store directory (created, or reopened to resume).
    storage_dtype : {"float16", "float32"}
        How tensors are stored (bf16 models should use float32 or float16).
    device, compute_dtype : str
        Where and in which dtype the model runs (default fp32 on CPU, bf16 on CUDA).
    depth : float, optional
        Fixed needle depth; None draws one per instance from its seed.
    config : CaptureConfig
        What to record.
    store_o_proj : bool
        Store every kept layer's ``o_proj`` weight (float32, once per store; the columns of the
        kept heads).
    progress : bool
        Show a tqdm progress bar.
    on_sequence : callable, optional
        Called as ``on_sequence(sequence_id, row)`` after each sequence is committed.
    prompts : sequence of PromptSpec, optional
        Validated lines of a prompts file (:func:`tracesim.capture.prompts.load_prompts`); their
        ``id``
        is the sequence id. Every prompt is rendered before the store is opened.
    layers, kv_heads : sequence of int, optional
        Model layers / KV heads to store (default all); each KV head brings its GQA group of
        query heads. ``model.json`` records the subset (field ``kept``).
    chat_template : bool
        Render prompts with the tokenizer's chat template (if it has one).
    """
    from tqdm.auto import tqdm

    from tracesim.store import TraceWriter

    unknown = [t for t in tasks if t not in TASKS]
    if unknown and prompts is None:
        raise ValueError(f"unknown task(s) {unknown}; expected some of {TASKS}")
    loaded = model if isinstance(model, LoadedModel) else load_model(model, device, compute_dtype)
    subset = model_subset(loaded, storage_dtype, layers, kv_heads)
    budget = config.max_new_tokens or 32
    if prompts is not None:
        # Render everything first: a bad prompt fails before any file is written.
        rendered = {p.id: render_prompt(loaded.tokenizer, p, chat_template=chat_template,
                                        max_new_tokens=budget) for p in prompts}
        plan = [(p.id, p.task, (lambda sid=p.id: rendered[sid])) for p in prompts]
        names = list(dict.fromkeys(p.task for p in prompts))
    else:
        for task in tasks:
            # Fail before writing anything if a task does not fit the length.
            build_prompt(loaded.tokenizer, task, length, instance_seed(task, length, seed, 0),
                         depth, chat_template)
        plan = [(sequence_id(t, length, seed, i), t,
                 (lambda t=t, i=i: build_prompt(loaded.tokenizer, t, length,
                                                instance_seed(t, length, seed, i), depth,
                                                chat_template)))
                for t in tasks for i in range(n)]
        names = list(tasks)
    o_proj = None
    if store_o_proj:
        W = o_proj_weights(loaded.model)[subset.layers]
        d = subset.meta.head_dim
        cols = [h * d + j for h in subset.heads for j in range(d)]
        o_proj = W[:, :, cols]
    summary = CaptureSummary([], [], {t: [] for t in names})
    with TraceWriter(out, subset.meta, o_proj=o_proj, kept=subset.kept) as writer:
        bar = tqdm(plan, desc="capture", unit="seq", disable=not progress)
        for sid, task, make in bar:
            if writer.has(sid):
                summary.skipped.append(sid)
                continue
            bar.set_postfix_str(sid)
            row, arrays = capture_prompt(loaded, make(), config, subset.layers)
            with writer.sequence(sid, **row) as sw:
                for layer, a in enumerate(arrays):
                    kv, q = subset.kv_heads, subset.heads
                    sw.add_layer(layer, keys=a.keys[kv], values=a.values[kv],
                                 queries=a.queries[q], outputs=a.outputs[q], h2o=a.h2o[q])
            summary.written.append(sid)
            if row["correct"] is not None:
                summary.correct[task].append(bool(row["correct"]))
            if on_sequence is not None:
                on_sequence(sid, row)
    return summary


def accuracy_table(correct: dict[str, list[bool]]) -> str:
    """A small text table of full-cache accuracy per task."""
    lines = [f"{'task':<10} {'n':>4} {'correct':>8} {'accuracy':>9}"]
    for task, flags in correct.items():
        acc = float(np.mean(flags)) if flags else float("nan")
        lines.append(f"{task:<10} {len(flags):>4} {sum(flags):>8} {acc:>9.2f}")
    return "\n".join(lines)
