"""Conf-KV in the loop: each decode step's budget set from the previous step's distribution.

:class:`ConfKVState` enforces a :class:`tracesim.capture.inloop.confkv.ConfKV` configuration
inside attention. The prefill runs on the full cache (shared with every configuration). Before
the forward that feeds the token generated at step ``t`` (its query at position ``t``), the
decode loop (:func:`decode_confkv`) hands the state the distribution that produced that token;
its confidence sets the step's budget share. At that step each layer holds the tokens of
``[lo, t)`` it sees (``lo = 0``, or ``t - w + 1`` on a sliding layer of window ``w``), of
which the ones still alive are kept up to ``k`` (:func:`tracesim.capture.inloop.confkv.
budget_tokens`); the excess, lowest-ranked outside the protected window and sinks, is evicted for
good (an additive ``-inf`` bias per KV head, so RoPE positions stay those of the full cache).
After the step's attention the accumulated attention mass of every token is updated from the
weights the model actually used (soft-cap, window and sinks included).

Outcome rows: ``score`` is ``confkv``, ``confkv_fixed`` or ``streaming``; ``kept_tokens_mean``
counts, per decode step, layer and KV head, the tokens of ``[lo, t)`` the layer holds (mean
over the steps), the figure C12 matches on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tracesim.capture.attention import CaptureState
from tracesim.capture.inloop.confkv import (
    ConfKV,
    budget_tokens,
    confidence,
    evict_order,
    rank_scores,
)

__all__ = ["ConfKVConfig", "ConfKVState", "confkv_from_cli", "decode_confkv", "initial_mass"]


def confkv_from_cli(names: str | None, params_json: str = "{}") -> list[ConfKV] | None:
    """The configurations of ``evict --confkv NAMES --confkv-params JSON``.

    Raises
    ------
    tracesim.errors.UsageError
        Naming the option and the field (exit status 2).
    """
    from tracesim.capture.inloop.confkv import MODES
    from tracesim.capture.inloop.peers import named_params

    from tracesim.errors import UsageError

    parsed = named_params(names, params_json, "--confkv", "{name: {field: value}}")
    if parsed is None:
        return None
    wanted, params = parsed
    bad = [n for n in wanted if n not in MODES] + sorted(set(params) - set(wanted))
    if not wanted or bad:
        raise UsageError(f"--confkv {names!r} / --confkv-params: {bad[0] if bad else 'nothing'}"
                         f" is not expected; names from {', '.join(MODES)}, and parameters only "
                         "for those")
    out = []
    for name in wanted:
        fields = dict(params.get(name, {}))
        if "mode" in fields:
            raise UsageError(f"--confkv-params: {name}.mode: the name sets the mode")
        if name == "streaming":
            fields.setdefault("sinks", 4)
        try:
            out.append(ConfKV(mode=name, **fields))
        except TypeError as exc:
            raise UsageError(f"--confkv-params: {name}: {exc}; expected fields of ConfKV "
                             "(budget_min, budget_max, budget, window, sinks, alpha, ema)"
                             ) from None
        except ValueError as exc:
            raise UsageError(f"--confkv-params: {name}: {exc}") from None
    return out


@dataclass(frozen=True)
class ConfKVConfig:
    """A Conf-KV family configuration as an in-loop run: its id and its policy columns."""

    confkv: ConfKV

    @property
    def id(self) -> str:
        return self.confkv.label

    needs_seeds = False

    def row(self) -> dict[str, Any]:
        """:data:`tracesim.policies.POLICY_COLUMNS`, null where the family has no such field."""
        from tracesim.policies import POLICY_COLUMNS

        c = self.confkv
        out: dict[str, Any] = dict.fromkeys(POLICY_COLUMNS)
        out.update(config_id=self.id, score={"confkv": "confkv", "fixed": "confkv_fixed",
                                              "streaming": "streaming"}[c.mode],
                   design=c.mode, budget=math.nan if c.budget is None else float(c.budget),
                   budget_unit="share", schedule="step", sinks=c.sinks, window=c.window,
                   certified=False, deployable=True,
                   score_params=str(sorted(c.to_dict().items())))
        return out


def initial_mass(h2o: np.ndarray, n_kv: int, window: int | None) -> np.ndarray:
    """Prompt tokens' starting attention mass ``(n_kv, P)``: the prefill's accumulated attention
    ``h2o`` ``(H, P)`` divided by the number of prompt queries that saw each token (``P - i``,
    at most ``window`` on a sliding layer), mean over each KV head's query heads."""
    H, P = h2o.shape
    seen = P - np.arange(P, dtype=np.float64)
    if window is not None:
        seen = np.minimum(seen, window)
    mean = h2o / seen[None, :]
    return mean.reshape(n_kv, H // n_kv, P).mean(axis=1)


class ConfKVState(CaptureState):
    """Per-run state enforcing a :class:`ConfKV` configuration at every decode step.

    Attributes
    ----------
    confidences, shares : list of float
        Per decode step: the confidence of the distribution that produced its token, and the
        budget share it set.
    step_positions : list of int
    step_kept, step_population : list of ndarray of int64, shape (n_layers, n_kv_heads)
        Per decode step: the tokens of ``[lo, t)`` each layer and KV head keeps, and ``t - lo``.
    """

    def __init__(self, prefill: Any, config: ConfKV) -> None:
        super().__init__(prefill.prompt_length, bias_fn=self._bias)
        self.config = config
        self.n_layers = len(prefill.traces)
        self.n_kv = prefill.traces[0].n_kv_heads
        self.mass = {tr.layer: initial_mass(tr.h2o, self.n_kv, tr.window)
                     for tr in prefill.traces}
        self.alive = {tr.layer: np.ones((self.n_kv, prefill.prompt_length), dtype=bool)
                      for tr in prefill.traces}
        self._share: float | None = None
        self._bias_now: dict[int, torch.Tensor] = {}
        self.confidences: list[float] = []
        self.shares: list[float] = []
        self.step_positions: list[int] = []
        self.step_kept: list[np.ndarray] = []
        self.step_population: list[np.ndarray] = []

    def set_logits(self, logits: torch.Tensor) -> None:
        """The next-token logits that produced the token the next forward feeds."""
        conf = confidence(logits.detach().double().cpu().numpy())
        self.confidences.append(conf)
        self._share = self.config.share(conf)
        self.shares.append(self._share)

    def _grow(self, layer: int, length: int) -> None:
        """Extend the layer's alive flags (True) and mass (0) to ``length`` positions."""
        extra = length - self.alive[layer].shape[1]
        if extra > 0:
            self.alive[layer] = np.pad(self.alive[layer], ((0, 0), (0, extra)),
                                       constant_values=True)
            self.mass[layer] = np.pad(self.mass[layer], ((0, 0), (0, extra)))

    def before_attention(self, layer: int, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor) -> None:
        q_len, kv_len = query.shape[2], key.shape[2]
        if q_len != 1 or kv_len <= self.prompt_length:
            return  # the prefill attends to the full cache
        if self._share is None:
            raise RuntimeError("ConfKVState: a decode step without set_logits")
        t = kv_len - 1
        self._grow(layer, kv_len)
        w = self.rule(layer).window
        lo = 0 if w is None else max(0, t - w + 1)
        n = t - lo
        cfg = self.config
        protected = np.zeros(n, dtype=bool)
        protected[max(0, n - cfg.window):] = True
        protected[:max(0, cfg.sinks - lo)] = True
        k = budget_tokens(self._share, n, int(protected.sum()))
        alive = self.alive[layer]
        for g in range(self.n_kv):
            held = alive[g, lo:t]
            excess = int(held.sum()) - k
            if excess <= 0:
                continue
            scores = (np.arange(n, dtype=np.float64) if cfg.mode == "streaming"
                      else rank_scores(self.mass[layer][g, lo:t][None], lo, t, cfg.alpha)[0])
            drop = evict_order(scores, held & ~protected, excess)
            alive[g, lo + drop] = False
        if not self.step_positions or self.step_positions[-1] != t:
            self.step_positions.append(t)
            self.step_kept.append(np.zeros((self.n_layers, self.n_kv), dtype=np.int64))
            self.step_population.append(np.zeros((self.n_layers, self.n_kv), dtype=np.int64))
        self.step_kept[-1][layer] = alive[:, lo:t].sum(axis=1)
        self.step_population[-1][layer] = n
        bias = np.where(alive[:, :kv_len], 0.0, -np.inf).astype(np.float32)
        self._bias_now[layer] = torch.from_numpy(bias)

    def _bias(self, layer: int, positions: torch.Tensor, kv_len: int) -> torch.Tensor | None:
        bias = self._bias_now.get(layer)
        if positions.numel() != 1 or bias is None or bias.shape[1] != kv_len:
            return None
        return bias[:, None, :]

    def record(self, layer, query, key, value, output, mask, scaling) -> None:
        """Update the accumulated attention mass from the step's own attention weights."""
        q_len, kv_len = query.shape[2], key.shape[2]
        if q_len != 1 or kv_len <= self.prompt_length:
            return
        rule = self.rule(layer)
        q = query[0, :, 0].double()  # (H, d)
        k = key[0].double()  # (n_kv, T, d)
        H = q.shape[0]
        qg = q.reshape(self.n_kv, H // self.n_kv, -1)
        logits = torch.einsum("kgd,ktd->kgt", qg, k) * float(scaling)
        if rule.softcap is not None:
            logits = rule.softcap * torch.tanh(logits / rule.softcap)
        bias = self._bias_now[layer].double().to(logits.device)
        if rule.window is not None and kv_len > rule.window:
            bias = bias.clone()
            bias[:, :kv_len - rule.window] = -math.inf
        logits = logits + bias[:, None, :]
        if rule.sinks is not None:  # a sink takes mass in the denominator, none in the tokens
            sink = rule.sinks.double().to(logits.device).reshape(self.n_kv, H // self.n_kv, 1)
            weights = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        else:
            weights = torch.softmax(logits, dim=-1)
        a = weights.mean(dim=1).cpu().numpy()  # (n_kv, T)
        e = self.config.ema
        self.mass[layer][:, :kv_len] = e * self.mass[layer][:, :kv_len] + (1 - e) * a


@torch.inference_mode()
def decode_confkv(model: Any, prefill: Any, config: ConfKV, max_new_tokens: int,
                  eos_ids: set[int]) -> Any:
    """Greedy decode under ``config`` from the prefill cache, then crop the cache back.

    Returns a :class:`tracesim.capture.inloop.evict.DecodeResult` (no certificates;
    ``kept_tokens`` ``(n_layers, n_kv)``: tokens of ``[lo, t)`` kept, mean over decode steps,
    NaN without a decode step) with the state as ``result.confkv_state``.
    """
    from tracesim.capture.attention import recording
    from tracesim.capture.generate import cache_keyword, forward_tokens
    from tracesim.capture.inloop.evict import DecodeResult, _restore

    P = prefill.prompt_length
    state = ConfKVState(prefill, config)
    cache_kw = cache_keyword(model)
    logits = prefill.logits
    generated: list[int] = []
    logprobs: list[float] = []
    try:
        with recording(model, state):
            while True:
                logp = torch.log_softmax(logits.float(), dim=-1)
                token = int(torch.argmax(logp))
                generated.append(token)
                logprobs.append(float(logp[token]))
                if token in eos_ids or len(generated) >= max_new_tokens:
                    break
                # the budget of the step that feeds this token comes from its distribution
                state.set_logits(logits)
                ids = torch.tensor([token], dtype=torch.long, device=logits.device)
                logits = forward_tokens(model, ids, P + len(generated) - 1, prefill.cache,
                                        cache_kw, state)
    finally:
        _restore(prefill.cache, P)
    kept = (np.mean(np.stack(state.step_kept), axis=0).astype(np.float64) if state.step_kept
            else np.full((len(prefill.traces), state.n_kv), math.nan))
    res = DecodeResult(generated, logprobs, bool(generated[-1] in eos_ids), [], kept, [])
    res.step_positions = list(state.step_positions)
    res.step_kept = list(state.step_kept)
    res.confkv_state = state
    return res
