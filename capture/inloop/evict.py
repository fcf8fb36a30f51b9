"""In-loop eviction: prefill once with the full cache, then decode every configuration from it.

For one sequence: the prompt is prefilled once with recording (observation-window queries and
H2O statistics), which yields exactly the per-layer :class:`~tracesim.policies.LayerTrace` the
offline simulator would read from a trace store. Every (policy, seed) then gets its kept sets from
the replay engine's own code (:func:`tracesim.replay.inclusion.first_event_inclusion`) and the
same permanent random numbers (bit-identical torch port), is enforced as an attention bias
(:mod:`tracesim.capture.inloop.enforce`), and decodes greedily from a copy of the prefill cache.
The cache is
cropped back to the prompt between configurations, so a grid costs one prefill plus one short
decode per configuration.

Both schedules are enforced: one-shot compression right after prefill, and decode-time eviction
every K steps, where each event re-plans every layer from what exists at that moment (the decode
queries generated under eviction included) with the nested rule ``kept while u < min pi``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tracesim.capture.attention import CaptureState, attention_modules, recording
from tracesim.capture.generate import decode_greedy, prefill
from tracesim.capture.inloop import perstep
from tracesim.capture.inloop.answer import AnswerSpan, answer_columns, plan_masks
from tracesim.capture.inloop.enforce import EvictionState, LayerPlan
from tracesim.capture.inloop.prn_torch import layer_uniforms_torch
from tracesim.capture.models import rope_info
from tracesim.capture.runner import query_roles
from tracesim.capture.tasks import grade
from tracesim.capture.variants import attention_variants

from tracesim.layer_trace import LayerTrace
from tracesim.policies import Policy
from tracesim.replay.kept import event_inclusion, first_event_inclusion

__all__ = ["Prefill", "decode_policy", "failure_label", "layer_plans", "prefill_sequence"]


@dataclass
class Prefill:
    """A prefilled prompt: the cache, the first-token logits and the layer traces; ``answer``
    is the prompt's answer span (:func:`tracesim.capture.inloop.answer.sequence_answer`), which the
    decodes from this prefill then report on (None: no span, null answer columns)."""

    cache: Any
    logits: torch.Tensor
    traces: list[LayerTrace]
    prompt_length: int
    grams: dict[int, torch.Tensor]
    answer: AnswerSpan | None = None


def _group_grams(model: Any, n_kv: int) -> dict[int, torch.Tensor]:
    """Per layer ``(H_kv, G*d, G*d)`` Gram matrices ``W_g^T W_g`` of the o_proj blocks."""
    grams = {}
    for layer, mod in enumerate(attention_modules(model)):
        w = mod.o_proj.weight.detach().float()  # (hidden, H*d)
        cols = w.shape[1] // n_kv
        blocks = [w[:, g * cols:(g + 1) * cols] for g in range(n_kv)]
        grams[layer] = torch.stack([b.T @ b for b in blocks])
    return grams


@torch.inference_mode()
def prefill_sequence(
    model: Any,
    prompt_ids: list[int],
    *,
    question_start: int,
    window: int = 32,
    scaling: float,
    layer_certificate: bool = True,
    prefill_chunk: int = 2048,
) -> Prefill:
    """Prefill ``prompt_ids`` with the full cache, recording what the scores need.

    Returns the cache (to decode from), the last position's logits (the first generated token is
    the same under every configuration: compression happens after prefill) and one float64
    :class:`LayerTrace` per layer over the prompt positions.
    """
    P = len(prompt_ids)
    positions, roles = query_roles(P, question_start, P, window, False)
    state = CaptureState(P, positions)
    with recording(model, state):
        cache, logits = prefill(model, prompt_ids, state=state, prefill_chunk=prefill_chunk)
    info = rope_info(model)
    rope = None if info["rope_theta"] is None else info
    # The scores must see each layer's attention as the model computes it: a sliding layer's
    # window, the logit soft-cap and learned sinks enter the trace (LayerTrace.attention).
    variants = attention_variants(model)
    kinds, caps, sinks = (variants["layer_attention"], variants["attn_logit_softcap"],
                          variants["sinks"])
    traces = []
    for layer, arrays in enumerate(state.finalize()):
        if arrays.positions.tolist() != positions:
            raise RuntimeError(f"layer {layer}: recorded query positions disagree with the plan")
        f64 = np.float64
        traces.append(LayerTrace(
            layer=layer, keys=arrays.keys.astype(f64), values=arrays.values.astype(f64),
            queries=arrays.queries.astype(f64), h2o=arrays.h2o.astype(f64),
            query_positions=np.asarray(positions, dtype=np.int64), query_roles=list(roles),
            prompt_length=P, question_start=int(question_start), scale=float(scaling),
            outputs=arrays.outputs.astype(f64), rope=rope,
            window=None if kinds is None else kinds[layer]["window"], softcap=caps,
            sinks=None if sinks is None else np.asarray(sinks[layer], dtype=f64)))
    n_kv = traces[0].n_kv_heads
    grams = _group_grams(model, n_kv) if layer_certificate else {}
    return Prefill(cache=cache, logits=logits, traces=traces, prompt_length=P, grams=grams)


def _stream0(seed: int, trace: LayerTrace) -> np.ndarray:
    return layer_uniforms_torch(seed, trace.layer, trace.n_kv_heads, trace.n_positions)


def layer_plans(traces: list[LayerTrace], policy: Policy, seed: int) -> dict[int, LayerPlan]:
    """Kept sets of every layer after the first event (compression right after prefill),
    exactly as the simulator draws them; none for a per-step design (its first event is the
    first decode step)."""
    plans: dict[int, LayerPlan] = {}
    if policy.schedule.per_step:
        # drawn at every decode step (tracesim.capture.inloop.perstep), none after prefill
        return plans
    n_layers = len(traces)
    for trace in traces:
        pi, kept = first_event_inclusion(trace, policy, int(seed), n_layers,
                                         uniforms=_stream0(seed, trace))
        plans[trace.layer] = LayerPlan.for_policy(pi, kept, policy)
    return plans


def _trace_at(prefill: Prefill, state: EvictionState, layer: int, tau: int) -> LayerTrace:
    """The layer as it exists at time ``tau``: prefill windows and H2O, the decode queries
    recorded so far, and the cache's keys and values at positions ``< tau``."""
    base = prefill.traces[layer]
    rec = state.layers[layer]
    f64 = np.float64
    keys = rec.keys[:, :tau].double().cpu().numpy()
    values = rec.values[:, :tau].double().cpu().numpy()
    dec_q = [q.double().cpu().numpy() for q in rec.queries]
    dec_pos = [p.numpy() for p in rec.positions]
    queries, positions = base.queries, base.query_positions
    roles = list(base.query_roles)
    if dec_q:
        pos = np.concatenate(dec_pos)
        keep = pos < tau
        queries = np.concatenate([queries, np.concatenate(dec_q, axis=1)[:, keep]], axis=1)
        positions = np.concatenate([positions, pos[keep]])
        roles += ["decode"] * int(keep.sum())
    h2o = np.zeros((base.n_heads, tau), dtype=f64)
    h2o[:, :base.n_positions] = base.h2o
    return LayerTrace(layer=layer, keys=keys, values=values, queries=queries, h2o=h2o,
                      query_positions=positions.astype(np.int64), query_roles=roles,
                      prompt_length=base.prompt_length, question_start=base.question_start,
                      scale=base.scale, rope=base.rope, window=base.window,
                      softcap=base.softcap, sinks=base.sinks)


@dataclass
class DecodeResult:
    """One configuration's decode from a shared prefill."""

    generated_ids: list[int]
    logprobs: list[float]
    stopped_on_eos: bool
    certificates: list[dict[int, tuple[np.ndarray, float]]]
    kept_tokens: np.ndarray  # (n_layers, n_kv) kept prompt tokens (per step: mean over steps)
    history: list[tuple[int, dict[int, LayerPlan]]] = field(default_factory=list)
    # (step, layer, tracesim.tiers.step.StepFetch) of an in-loop fetch run
    fetch_log: list[tuple[int, int, Any]] = field(default_factory=list)
    # per-step designs: query position of every decode step, and (n_layers, n_kv) tokens of
    # [0, t) attended at it (tracesim.capture.inloop.perstep.PerStepState)
    step_positions: list[int] = field(default_factory=list)
    step_kept: list[np.ndarray] = field(default_factory=list)
    # with an answer span: (S, n_layers, n_kv, n) kept flags and inclusion probabilities of its
    # tokens per decode step (tracesim.capture.inloop.answer; pi None unless the design is
    # randomized)
    answer: AnswerSpan | None = None
    answer_kept: np.ndarray | None = None
    answer_pi: np.ndarray | None = None


@torch.inference_mode()
def decode_policy(model: Any, prefill: Prefill, plans: dict[int, LayerPlan],
                  max_new_tokens: int, eos_ids: set[int], policy: Policy | None = None,
                  seed: int = 0, fetch: Any = None, one_pass: bool = True) -> DecodeResult:
    """Greedy decode under ``plans`` from the prefill cache, then crop the cache back.

    With a decode-time ``policy`` (``schedule="decode:K"``) every layer is re-planned at each
    event from what exists then, with the nested rule (``kept while u < min pi``). With a
    :class:`tracesim.capture.inloop.fetch.FetchConfig` (one-shot plans only) every decode step and
    layer also
    fetches evicted pages by that scheduler (:class:`tracesim.capture.inloop.fetch.FetchState`). A
    per-step ``policy`` (``schedule="step"``) draws every layer's kept set at every decode step
    from that step's query (:class:`tracesim.capture.inloop.perstep.PerStepState`; ``plans`` is then
    empty). ``one_pass=False`` runs SDPA and the two-pass certificates (the reference path).
    """
    P = prefill.prompt_length
    check_inloop_variants(model, policy, plans, fetch)
    events: set[int] = set()
    replan = None
    if policy is not None and policy.schedule.kind == "decode":
        L = policy.score.compress_end(prefill.traces[0])
        events = set(int(t) for t in policy.schedule.event_times(L, P, P + max_new_tokens)
                     if t > P)
        n_layers = len(prefill.traces)

        def replan(tau: int) -> dict[int, LayerPlan]:
            out = {}
            for layer in range(n_layers):
                trace = _trace_at(prefill, state, layer, tau)
                pi, kept = event_inclusion(trace, policy, int(seed), n_layers, tau,
                                           uniforms=_stream0(seed, trace))
                out[layer] = LayerPlan.for_policy(pi, kept, policy)
            return out

    per_step = policy is not None and policy.schedule.per_step
    if per_step:
        if fetch is not None:
            raise ValueError("fetch: in-loop fetches need one-shot eviction (schedule: oneshot)")
        state = perstep.PerStepState(prefill, policy, seed, one_pass=one_pass)
    elif fetch is not None:
        from tracesim.capture.inloop.fetch import FetchState

        if replan is not None:
            raise ValueError("fetch: in-loop fetches need one-shot eviction (schedule: oneshot)")
        state = FetchState(P, plans, prefill.grams, fetch=fetch, seed=seed,
                           n_layers=len(prefill.traces))
    else:
        state = EvictionState(P, plans, prefill.grams, event_times=events, replan=replan,
                              one_pass=one_pass)
    try:
        with recording(model, state):
            generated, logprobs = decode_greedy(model, prefill.cache, prefill.logits, P,
                                                max_new_tokens, eos_ids, state=state)
        state.end()
    finally:
        _restore(prefill.cache, P)
    plans = state.plans
    if per_step and state.step_kept:
        # tokens of the prompt a step reads, mean over the decode steps
        kept = np.mean(state.prompt_kept, axis=0)
    else:
        kept = (np.stack([plans[layer].kept[:, :P].sum(dim=1).numpy() for layer in sorted(plans)])
                if plans else np.full((1, 1), P))
    result = DecodeResult(generated, logprobs, bool(generated[-1] in eos_ids),
                          state.certificates, kept, state.history,
                          list(getattr(state, "fetch_log", [])),
                          list(getattr(state, "step_positions", [])),
                          list(getattr(state, "step_kept", [])))
    if prefill.answer is not None:
        _answer_masks(result, prefill, state, policy)
    return result


def check_inloop_variants(model: Any, policy: Policy | None, plans: dict[int, LayerPlan],
                          fetch: Any = None) -> None:
    """Refuse, before decoding, what the loop does not enforce faithfully on this model.

    One-shot and decode-time eviction honour sliding windows (the model's mask, and the window
    folded into the one-pass bias) and run soft-capped or sink layers through the model's eager
    rule; per-step designs draw within a sliding layer's window. Certificates of soft-cap or
    sink layers, per-step designs on soft-cap or sink layers, and fetches and peers on any
    attention variant, are not implemented yet.

    Raises
    ------
    ValueError
        Naming the variant and what to use instead.
    """
    rule = attention_variants(model)
    named = [name for name, on in (("soft-cap", rule["attn_logit_softcap"] is not None),
                                   ("sinks", rule["sinks"] is not None)) if on]
    certified = (policy.certified if policy is not None
                 else any(p.certified for p in plans.values()))
    if named and certified:
        raise ValueError(f"in-loop certificates with attention {' and '.join(named)} are not "
                         "implemented; use an uncertified policy (or the replay)")
    sliding = rule["layer_attention"] is not None
    # Per-step designs draw within a sliding layer's window (the step's trace carries it, and
    # the inclusion tables treat (t - w, t] as the population); soft-caps and sinks they do not
    # model in the loop yet, nor do fetches any variant.
    per_step = policy is not None and policy.schedule.per_step
    if (fetch is not None and (named or sliding)) or (per_step and named):
        what = "fetches" if fetch is not None else "per-step designs"
        variants = " and ".join(named + ["sliding windows"] * (sliding and fetch is not None))
        raise ValueError(f"in-loop {what} on a model with {variants} are not implemented; use "
                         "the replay")


def _answer_masks(result: DecodeResult, prefill: Prefill, state: EvictionState,
                  policy: Policy | None) -> None:
    """Set ``result``'s answer-span flags and probabilities from the run's plans (one-shot,
    decode-time) or from what a per-step design drew at each step. Fetched pages are not
    counted as kept: the flags describe the eviction plan."""
    randomized = (policy is not None and policy.design is not None
                  and policy.design.randomized and policy.score.evicts)
    result.answer = prefill.answer
    if isinstance(state, perstep.PerStepState):
        if state.answer_kept:  # none without a decode step: null shares
            result.answer_kept = np.stack(state.answer_kept)
            result.answer_pi = np.stack(state.answer_pi) if randomized else None
        return
    history = state.history or [(prefill.prompt_length, state.plans)]
    kept, pi = plan_masks(history, len(result.generated_ids), prefill.prompt_length,
                          len(prefill.traces), prefill.traces[0].n_kv_heads,
                          prefill.answer.positions)
    result.answer_kept, result.answer_pi = kept, (pi if randomized else None)


def _restore(cache: Any, length: int) -> None:
    """Drop every cached position from ``length`` on (the generated tokens of one decode)."""
    extra = int(cache.get_seq_length()) - length
    if extra > 0:
        # transformers 5 takes the number of tokens to remove as a negative count.
        cache.crop(-extra)


def failure_label(correct: bool, full_correct: bool) -> str:
    """``cache_induced`` (full right, evicted wrong), ``inherent`` (both wrong), ``recovered``
    (full wrong, evicted right) or ``none`` (both right)."""
    if correct:
        return "none" if full_correct else "recovered"
    return "cache_induced" if full_correct else "inherent"


def outcome_row(meta: dict[str, Any], policy: Policy, seed: int, result: DecodeResult,
                tokenizer: Any, n_layers: int, *, n_kv: int | None = None,
                head_dim: int | None = None, memory: Any = None) -> dict[str, Any]:
    """One outcomes row: answer, correctness, log-probs, certificate aggregates, memory, the
    answer-span columns (:func:`tracesim.capture.inloop.answer.answer_columns`, null unless the
    prefill had a span); with ``n_kv`` and ``head_dim`` also the per-step costs
    (:func:`tracesim.capture.inloop.perstep.step_columns`, ``memory`` a tiers memory model)."""
    gen = result.generated_ids
    answer_ids = gen[:-1] if result.stopped_on_eos else gen
    answer = tokenizer.decode(answer_ids, skip_special_tokens=True) if tokenizer else ""
    correct = grade(meta["task"], answer, meta["gold"]) if tokenizer else False
    full_correct = bool(meta["correct"])
    full_ids = list(meta["generated_ids"])
    certs = np.array([[c[layer][0] for layer in range(n_layers) if layer in c]
                      for c in result.certificates]) if result.certificates else np.zeros((0,))
    layer_certs = np.array([[c[layer][1] for layer in range(n_layers) if layer in c]
                            for c in result.certificates]) if result.certificates else None
    nan = math.nan
    by_layer = (np.sqrt(certs).mean(axis=(0, 2)).tolist() if certs.size else [])
    P = int(meta["prompt_length"])
    kept = result.kept_tokens
    steps = {}
    if n_kv is not None and head_dim is not None:

        steps = perstep.step_columns(policy, result, P, n_layers, int(n_kv), int(head_dim), memory)
    return {
        **policy.row(),
        "sequence_id": meta["sequence_id"], "task": meta["task"], "seed": int(seed),
        "answer": answer, "gold": meta["gold"], "correct": bool(correct),
        "full_correct": full_correct, "failure": failure_label(correct, full_correct),
        "same_tokens_as_full": gen == full_ids[:len(gen)] and len(gen) == len(full_ids),
        "n_generated": len(gen),
        "logprob_mean": float(np.mean(result.logprobs)),
        "logprob_min": float(np.min(result.logprobs)),
        "logprob_first": float(result.logprobs[0]),
        "certificate_mean": float(np.sqrt(certs).mean()) if certs.size else nan,
        "certificate_max": float(np.sqrt(certs).max()) if certs.size else nan,
        "layer_certificate_mean": (float(np.sqrt(layer_certs).mean())
                                   if layer_certs is not None and layer_certs.size else nan),
        "layer_certificate_max": (float(np.sqrt(layer_certs).max())
                                  if layer_certs is not None and layer_certs.size else nan),
        "certificate_by_layer": by_layer,
        "prompt_length": P,
        "kept_tokens_mean": float(kept.mean()),
        "kept_fraction": float(kept.mean() / P),
        "memory_tokens": int(round(float(kept.sum()))),
        "full_memory_tokens": int(P * kept.size),
        **steps,
        **answer_columns(result.answer, result.answer_kept, result.answer_pi),
    }
