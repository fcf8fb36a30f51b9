"""Per-step designs in the loop: every decode step and layer draws its own kept set.

A policy whose schedule is ``step`` (:class:`tracesim.schedules.Schedule`) is planned afresh at
every decode step and layer, inside the attention call, from that step's own query: the layer as
it exists at that moment (the prefill windows, the decode queries generated under the design so
far, the current query, and the cache's keys and values up to and including the current token)
becomes a :class:`~tracesim.policies.LayerTrace`, and the replay engine's inclusion code
(:func:`tracesim.replay.kept.event_inclusion`, event at the step's position) gives ``pi`` and the
kept set, with the step's fresh uniforms (or stream 0, per the schedule's coordination). Nothing
is nested: the whole cache stays in the lower tier, and a token one step drops may be read at
the next. The kept set is enforced, with the Hájek offset ``-log pi`` and the serving-time
certificates, exactly as the one-shot path enforces its plan
(:class:`tracesim.capture.inloop.enforce.EvictionState`).

The prefill itself runs on the full cache (the first generated token is the same under every
configuration); the first per-step draw is at the first decode step.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from tracesim.capture.attention import LayerRecord
from tracesim.capture.inloop.enforce import EvictionState, LayerPlan
from tracesim.capture.inloop.prn_torch import layer_uniforms_torch

from tracesim.layer_trace import LayerTrace
from tracesim.policies import Policy
from tracesim.proxies.base import carry_summaries, proxy_summaries
from tracesim.replay.kept import event_inclusion

__all__ = ["STEP_COLUMNS", "PerStepState", "step_columns", "step_trace"]


def step_trace(base: LayerTrace, record: LayerRecord | None, query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor) -> LayerTrace:
    """The layer at the decode step whose query sits at the cache's last position ``t``.

    Parameters
    ----------
    base : LayerTrace
        The layer's prefill trace (prompt windows and H2O statistics).
    record : LayerRecord or None
        What the run recorded so far: the decode queries of the earlier steps.
    query : torch.Tensor, shape (n_heads, head_dim)
        The step's query (post-RoPE).
    key, value : torch.Tensor, shape (n_kv_heads, t + 1, head_dim)
        The cache at this step, the current token included.

    Returns
    -------
    LayerTrace
        float64, ``n_positions = t + 1``, the step's query last with role ``decode``.
    """
    f64 = np.float64
    t = key.shape[1] - 1
    queries = [base.queries]
    positions = [base.query_positions]
    roles = list(base.query_roles)
    if record is not None and record.queries:
        pos = torch.cat(record.positions).numpy()
        keep = pos < t
        queries.append(torch.cat([q.double().cpu() for q in record.queries], dim=1).numpy()[
            :, keep])
        positions.append(pos[keep])
        roles += ["decode"] * int(keep.sum())
    queries.append(query.double().cpu().numpy()[:, None, :])
    positions.append(np.array([t], dtype=np.int64))
    roles.append("decode")
    h2o = np.zeros((base.n_heads, t + 1), dtype=f64)
    h2o[:, :base.n_positions] = base.h2o
    return LayerTrace(layer=base.layer, keys=key.double().cpu().numpy(),
                      values=value.double().cpu().numpy(), queries=np.concatenate(queries, 1),
                      h2o=h2o, query_positions=np.concatenate(positions).astype(np.int64),
                      query_roles=roles, prompt_length=base.prompt_length,
                      question_start=base.question_start, scale=base.scale, rope=base.rope,
                      window=base.window, softcap=base.softcap, sinks=base.sinks)


class PerStepState(EvictionState):
    """:class:`EvictionState` that re-plans every layer at every decode step (schedule ``step``).

    Parameters
    ----------
    prefill : tracesim.capture.inloop.evict.Prefill
        The shared prefill (its traces, prompt length and Gram matrices).
    policy : Policy
        A per-step policy (``policy.schedule.per_step``).
    seed : int
    one_pass : bool
        As for :class:`EvictionState` (False: SDPA and the two-pass certificates, the
        reference path).

    Attributes
    ----------
    step_positions : list of int
        Query position ``t`` of every decode step.
    step_kept : list of ndarray of int64, shape (n_layers, n_kv_heads)
        Per decode step: the tokens of ``[0, t)`` each KV head attends (the current token, always
        kept, not counted).
    prompt_kept : list of ndarray of int64, shape (n_layers, n_kv_heads)
        Per decode step: the prompt tokens each KV head attends.
    answer_kept, answer_pi : list of ndarray, shape (n_layers, n_kv_heads, n)
        Per decode step, with an answer span on the prefill (``prefill.answer``, a
        :class:`tracesim.capture.inloop.answer.AnswerSpan` of ``n`` tokens): whether each span
        token is
        attended (bool), and its inclusion probability (float64). Empty without a span.
    """

    def __init__(self, prefill: Any, policy: Policy, seed: int, *, one_pass: bool = True) -> None:
        if not policy.schedule.per_step:
            raise ValueError(f"PerStepState: policy {policy.id} has schedule "
                             f"{policy.schedule.kind!r}; expected a per-step ('step') schedule")
        super().__init__(prefill.prompt_length, {}, prefill.grams, one_pass=one_pass)
        # Later steps' traces hold the decode queries generated under the design.
        self.record_from = prefill.prompt_length
        # No event after prefill; the per-step log below replaces the events' history.
        self.history = []
        self.prefill = prefill
        self.policy = policy
        self.seed = int(seed)
        self.n_layers = len(prefill.traces)
        self.step_positions: list[int] = []
        self.step_kept: list[np.ndarray] = []
        self.prompt_kept: list[np.ndarray] = []
        span = getattr(prefill, "answer", None)
        self._answer_positions = None if span is None else span.positions
        self.answer_kept: list[np.ndarray] = []
        self.answer_pi: list[np.ndarray] = []
        # Per layer: the proxy summaries of its last step, extended at the next one (SimHash
        # codes are built once per layer, then one appended per token).
        self._proxy_summaries: dict[int, dict] = {}

    def before_attention(self, layer: int, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor) -> None:
        q_len, kv_len = query.shape[2], key.shape[2]
        if q_len != 1 or kv_len <= self.prompt_length:
            return  # the prefill attends to the full cache
        t = kv_len - 1
        trace = step_trace(self.prefill.traces[layer], self.layers.get(layer), query[0, :, 0],
                           key[0], value[0])
        carry_summaries(self._proxy_summaries.get(layer, {}), trace)
        # Fresh coordination draws the step's own stream inside event_inclusion; permanent
        # uses stream 0, from the torch port as the one-shot path does.
        uniforms = None if self.policy.schedule.fresh else layer_uniforms_torch(
            self.seed, trace.layer, trace.n_kv_heads, trace.n_positions)
        pi, kept = event_inclusion(trace, self.policy, self.seed, self.n_layers, t,
                                   uniforms=uniforms)
        self._proxy_summaries[layer] = proxy_summaries(trace)
        self.plans[layer] = LayerPlan.for_policy(pi, kept, self.policy)
        if not self.step_positions or self.step_positions[-1] != t:
            self.step_positions.append(t)
            self.step_kept.append(np.zeros((self.n_layers, trace.n_kv_heads), dtype=np.int64))
            self.prompt_kept.append(np.zeros((self.n_layers, trace.n_kv_heads), dtype=np.int64))
            if self._answer_positions is not None:
                shape = (self.n_layers, trace.n_kv_heads, self._answer_positions.size)
                self.answer_kept.append(np.zeros(shape, dtype=bool))
                self.answer_pi.append(np.zeros(shape))
        self.step_kept[-1][layer] = kept[:, :t].sum(axis=1)
        self.prompt_kept[-1][layer] = kept[:, :self.prompt_length].sum(axis=1)
        if self._answer_positions is not None:
            self.answer_kept[-1][layer] = kept[:, self._answer_positions]
            self.answer_pi[-1][layer] = pi[:, self._answer_positions]


#: Per-step cost columns of an outcome row (``docs/columns.md``); one value per run.
STEP_COLUMNS = ("step_tokens_mean", "step_tokens_fraction", "step_rows_read", "step_bytes",
                "step_link_bytes", "step_us")


def _tokens_per_step(policy: Policy, result: Any, prompt_length: int, n_layers: int,
                     n_kv: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens of ``[0, t)`` attended per step, layer and KV head ``(S, L, n_kv)``, ``t (S,)``)."""
    if result.step_positions:
        return np.stack(result.step_kept).astype(np.float64), np.array(result.step_positions)
    n_steps = max(len(result.generated_ids) - 1, 0)
    positions = prompt_length + np.arange(n_steps)
    out = np.empty((n_steps, n_layers, n_kv))
    history = result.history or [(prompt_length, {})]
    taus = np.array([tau for tau, _ in history])
    for s, t in enumerate(positions):
        tau, plans = history[max(int(np.searchsorted(taus, t, side="right")) - 1, 0)]
        for layer in range(n_layers):
            plan = plans.get(layer)
            if plan is None:
                out[s, layer] = t
            else:  # the plan covers [0, tau); every later token is kept
                out[s, layer] = plan.kept[:, :tau].sum(dim=1).numpy() + (t - tau)
    return out, positions


def step_columns(policy: Policy, result: Any, prompt_length: int, n_layers: int, n_kv: int,
                 head_dim: int, memory: Any = None) -> dict[str, float]:
    """Per-step cost columns of one run, from the :mod:`tracesim.tiers` memory model.

    Per decode step at position ``t``, summed over layers and KV heads, with ``b`` the bytes of
    one token of one KV head (:meth:`tracesim.tiers.model.MemoryModel.token_bytes`) and ``k``
    the tokens of ``[0, t)`` the step attends:

    * ``step_tokens_mean``: ``k``, mean over steps, layers and KV heads;
      ``step_tokens_fraction``: mean of ``k / t``;
    * ``step_rows_read``: rows a per-step design reads from the lower tier,
      ``k - sinks - window`` (the sinks, the window and the current token stay in HBM; 0 for
      the other schedules, whose kept set is resident);
    * ``step_bytes``: bytes attention reads, ``k b`` plus, for a per-step design, the proxy's
      summary of the ``t`` cached tokens (``t x proxy bits / 8``);
    * ``step_link_bytes``: ``step_rows_read x b``, the bytes over the link;
    * ``step_us``: modelled time of those transfers on the first lower tier, rows scattered
      (one transfer each), as ``tracesim.analysis.perstep_costs`` models them (microseconds).

    Every column is a mean over the run's decode steps (NaN when it has none).
    """
    from tracesim.tiers.model import MemoryModel

    memory = memory or MemoryModel()
    kept, positions = _tokens_per_step(policy, result, prompt_length, n_layers, n_kv)
    if kept.shape[0] == 0:
        return dict.fromkeys(STEP_COLUMNS, math.nan)
    b = memory.token_bytes(head_dim)
    per_step = policy.schedule.per_step and policy.score.evicts
    tokens = kept.sum(axis=(1, 2))  # (S,)
    step_bytes = tokens * b
    resident = policy.score.sinks + policy.score.window
    rows = np.zeros_like(tokens)
    if per_step:
        rows = np.maximum(kept - np.minimum(resident, positions)[:, None, None], 0).sum((1, 2))
        bits = policy.score.proxy_bits(head_dim)
        step_bytes = step_bytes + positions * n_layers * n_kv * bits / 8
    # Layers run one after another: each fetches its own rows, scattered, one transfer each.
    layer_rows = (np.maximum(kept - np.minimum(resident, positions)[:, None, None], 0).sum(2)
                  if per_step else np.zeros(kept.shape[:2]))
    seconds = memory.lower[0].fetch_seconds(layer_rows, layer_rows * b).sum(axis=1)
    return {
        "step_tokens_mean": float(kept.mean()),
        "step_tokens_fraction": float((kept / positions[:, None, None]).mean()),
        "step_rows_read": float(rows.mean()),
        "step_bytes": float(step_bytes.mean()),
        "step_link_bytes": float((rows * b).mean()),
        "step_us": float(np.mean(seconds) * 1e6),
    }
