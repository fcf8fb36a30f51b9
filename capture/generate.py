"""Greedy generation with an explicit loop (``generate()`` rejects the keyword arguments we need).

Prefill runs in query chunks against a :class:`~transformers.DynamicCache`, then one token per
step with explicit ``position_ids``. Every generated token's log-probability under the full cache
is kept. The last generated token is never fed back, so the fed positions (whose K/V a trace
stores) are the prompt plus all generated tokens but the last.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from tracesim.capture.attention import CaptureState
from transformers import DynamicCache


@dataclass
class Generation:
    """Result of :func:`greedy_generate`.

    Attributes
    ----------
    fed_ids : list of int
        Every position fed to the model: prompt, then generated tokens but the last.
    generated_ids : list of int
        Greedy tokens, the EOS token included when generation stopped on it.
    logprobs : list of float
        Log-probability of each generated token under the full-cache model, parallel to
        ``generated_ids``.
    stopped_on_eos : bool
        Whether the last generated token is an EOS token.
    """

    fed_ids: list[int]
    generated_ids: list[int]
    logprobs: list[float]
    stopped_on_eos: bool


def cache_keyword(model: torch.nn.Module) -> str:
    """Name of the model's cache keyword argument (``cache`` or ``past_key_values``)."""
    # transformers 5.24 renamed ``past_key_values`` to ``cache``; older 5.x only know the former.
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward_tokens(model, ids: torch.Tensor, start: int, cache, cache_kw: str,
                   state) -> torch.Tensor:
    """Feed ``ids`` (``(n,)``) at positions ``start..start+n-1``; return last-position logits."""
    stop = start + ids.numel()
    if state is not None:
        state.begin_step(start, stop)
    positions = torch.arange(start, stop, device=ids.device)[None]
    out = model(
        input_ids=ids[None],
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{cache_kw: cache},
    )
    return out.logits[0, -1]


@torch.inference_mode()
def greedy_generate(
    model: torch.nn.Module,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: Iterable[int] = (),
    *,
    state: CaptureState | None = None,
    prefill_chunk: int = 2048,
) -> Generation:
    """Greedy decoding of one prompt (batch size 1).

    Parameters
    ----------
    model : transformers causal LM
        Any attention implementation; to record, load it with ``CAPTURE_ATTN`` and run this inside
        :func:`tracesim.capture.attention.recording` with the same ``state``.
    prompt_ids : sequence of int
        ``(prompt_length,)`` token ids.
    max_new_tokens : int
        At most this many tokens are generated (>= 1).
    eos_ids : iterable of int
        Generation stops after emitting any of these.
    state : CaptureState, optional
        Told which positions each forward feeds, so recording can check the cache.
    prefill_chunk : int
        Prompt tokens per prefill forward; bounds the ``(H, chunk, kv_len)`` attention memory.

    Returns
    -------
    Generation
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(prompt_ids) == 0:
        raise ValueError("empty prompt")
    eos = {int(t) for t in eos_ids}
    cache, logits = prefill(model, prompt_ids, state=state, prefill_chunk=prefill_chunk)
    generated, logprobs = decode_greedy(model, cache, logits, len(prompt_ids), max_new_tokens,
                                        eos, state=state)
    fed = [int(t) for t in prompt_ids] + generated[:-1]
    return Generation(fed, generated, logprobs, bool(generated[-1] in eos))


def prefill(
    model: torch.nn.Module,
    prompt_ids: Sequence[int],
    *,
    state: CaptureState | None = None,
    prefill_chunk: int = 2048,
) -> tuple[DynamicCache, torch.Tensor]:
    """Feed the prompt in chunks into a new cache; return the cache and the last logits.

    Parameters
    ----------
    prompt_ids : sequence of int, shape (prompt_length,)
    state : CaptureState, optional
        Told which positions each forward feeds.
    prefill_chunk : int
        Prompt tokens per forward; bounds the ``(H, chunk, kv_len)`` attention memory.

    Returns
    -------
    (cache, logits) : the cache holding every prompt position, and the next-token logits
        ``(vocab,)`` at the last prompt position.
    """
    device = next(model.parameters()).device
    # A cache of full layers, sliding ones included: each layer keeps every position, so capture
    # records all keys and a budget can address any of them. The model's computation is
    # unchanged: a sliding layer's mask (built from config.sliding_window, not from the cache)
    # still limits its queries to the window, exactly as the model's own sliding cache does.
    cache = DynamicCache()
    cache_kw = cache_keyword(model)
    prompt = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    logits = None
    for start in range(0, prompt.numel(), prefill_chunk):
        logits = forward_tokens(model, prompt[start:start + prefill_chunk], start, cache,
                                cache_kw, state)
    return cache, logits


def decode_greedy(
    model: torch.nn.Module,
    cache,
    logits: torch.Tensor,
    start: int,
    max_new_tokens: int,
    eos_ids: Iterable[int] = (),
    *,
    state: CaptureState | None = None,
) -> tuple[list[int], list[float]]:
    """Greedy decoding from a filled cache.

    Parameters
    ----------
    cache : transformers cache holding positions ``0..start-1``
    logits : torch.Tensor, shape (vocab,)
        Next-token logits at position ``start - 1`` (from the prefill or a previous step).
    start : int
        Position of the first generated token.
    max_new_tokens : int
    eos_ids : iterable of int
    state : CaptureState, optional

    Returns
    -------
    (generated_ids, logprobs) : lists, the EOS token included when generation stopped on it.
    """
    eos = {int(t) for t in eos_ids}
    device = logits.device
    cache_kw = cache_keyword(model)
    generated: list[int] = []
    logprobs: list[float] = []
    while True:
        logp = torch.log_softmax(logits.float(), dim=-1)
        token = int(torch.argmax(logp))
        generated.append(token)
        logprobs.append(float(logp[token]))
        if token in eos or len(generated) >= max_new_tokens:
            return generated, logprobs
        ids = torch.tensor([token], dtype=torch.long, device=device)
        logits = forward_tokens(model, ids, start + len(generated) - 1, cache, cache_kw, state)
