"""Enforcing an eviction configuration inside attention, with serving-time certificates.

:class:`EvictionState` is a :class:`~tracesim.capture.attention.CaptureState` whose bias hook
applies, per
KV head, an additive fp32 bias over the prompt positions: ``-inf`` for evicted tokens,
``-log pi_i`` for kept tail tokens (Hájek) or ``0`` (uncorrected), and 0 for take-all tokens and
for every generated token. Masking instead of removing tokens keeps every position's RoPE phase
exactly as in the full-cache run.

At each decode step it also computes, in torch, from what the cache retains only:

* the primary certificate ``C^2 = sum_{i in S} (1 - pi_i) a_i^2 ||v_i - o_hat||^2`` per head;
* the per-layer output-space (GQA) certificate
  ``sum_g sum_{i in S_g} (1 - pi_i) || sum_{h in g} a_{h,i} W_O,h (v_i - o_hat_h) ||^2``
  through each group's Gram matrix ``W_g^T W_g``.

By default a certified decode step computes the attention output and both certificates in one
blocked pass over the cache (:func:`tracesim.capture.inloop.onepass.onepass_attention`,
online-softmax rescaling
of ``sum c``, ``sum c v`` and ``sum c ||v||^2``), instead of SDPA followed by a second pass over
the residuals ``v_i - o_hat`` (:func:`serving_certificates`, kept as the reference and used with
``one_pass=False``). Both match the offline estimator to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from tracesim.capture.attention import CaptureState
from tracesim.capture.inloop.onepass import (
    fixed_size_inflation,
    group_queries,
    onepass_attention,
    pair_quadratic_forms,
)

from tracesim.policies import Policy

__all__ = ["EvictionState", "LayerPlan", "serving_certificates"]


@dataclass
class LayerPlan:
    """The eviction plan of one layer over the prompt positions.

    Attributes
    ----------
    pi : torch.Tensor, shape (n_kv_heads, P), float64
        Inclusion probabilities (1 = take-all, 0 = never eligible).
    kept : torch.Tensor of bool, shape (n_kv_heads, P)
    hajek : bool
        Apply the ``-log pi`` offset to kept tail tokens.
    certified : bool
        Compute certificates (randomized design with the Hájek correction).
    fixed_size : bool
        The design is fixed-size order sampling (Rosén's variance for the primary certificate).
    """

    pi: torch.Tensor
    kept: torch.Tensor
    hajek: bool
    certified: bool
    fixed_size: bool = False

    @classmethod
    def for_policy(cls, pi: np.ndarray, kept: np.ndarray, policy: Policy) -> LayerPlan:
        """The plan of ``policy`` from the replay's ``pi`` and kept mask (numpy arrays of shape
        ``(n_kv_heads, P)``): the Hájek offset, certification and the fixed-size variance
        follow the policy."""
        return cls(pi=torch.from_numpy(pi), kept=torch.from_numpy(np.asarray(kept, bool)),
                   hajek=policy.correction == "hajek", certified=policy.certified,
                   fixed_size=policy.design is not None and policy.design.variance == "fixed")
    bias: torch.Tensor = field(init=False)
    tail_index: torch.Tensor = field(init=False)
    tail_weight: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        offset = -torch.log(self.pi) if self.hajek else torch.zeros_like(self.pi)
        bias = torch.where(self.kept, offset, torch.full_like(self.pi, float("-inf")))
        self.bias = bias.to(torch.float32)
        tail = self.kept & (self.pi < 1)
        # Kept tail positions per KV head, padded to the longest with weight 0.
        counts = tail.sum(dim=1)
        m = max(1, int(counts.max()))
        self.tail_index = torch.zeros(tail.shape[0], m, dtype=torch.long)
        self.tail_weight = torch.zeros(tail.shape[0], m, dtype=torch.float32)
        for g in range(tail.shape[0]):
            idx = torch.nonzero(tail[g]).flatten()
            self.tail_index[g, :idx.numel()] = idx
            self.tail_weight[g, :idx.numel()] = (1.0 - self.pi[g, idx]).float()

    @property
    def evicts(self) -> bool:
        return bool((~self.kept).any()) or (self.hajek and bool((self.pi < 1).any()))


def serving_certificates(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor,
    tail_index: torch.Tensor,
    tail_weight: torch.Tensor,
    scaling: float,
    gram: torch.Tensor | None = None,
    fixed_size: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Hájek outputs and certificates of one decode query from the retained cache.

    Parameters
    ----------
    query : (H, d)
    key, value : (H_kv, T, d)
    bias : (H_kv, T) float
        Additive logit bias (``-inf`` evicted, ``-log pi`` kept tail, 0 otherwise).
    tail_index : (H_kv, m) long
        Positions of the kept tail tokens of each KV head, padded (padding has weight 0).
    tail_weight : (H_kv, m)
        ``1 - pi`` of those tokens, 0 for padding. Only the sampled tail enters the variance,
        so the certificate pass costs ``O(m)`` per head rather than ``O(T)``.
    scaling : float
    gram : (H_kv, G*d, G*d), optional
        ``W_g^T W_g`` per group for the output-space certificate.
    fixed_size : bool
        Rosén's fixed-size variance for order-sampling designs: with ``z_i = a_i (v_i - o_hat)``,
        ``m/(m-1) sum_S (1 - pi_i) (z_i - A)^2`` where ``A`` is the ``(1 - pi)``-weighted mean
        of ``z`` over the sampled tail. The output-space certificate keeps the Poisson form, as
        the replay engine does.

    Returns
    -------
    output : (H, d)
    certificate_sq : (H,)
        ``C^2`` per query head.
    layer_certificate_sq : scalar tensor or None
        Output-space ``C^2`` summed over groups.
    """
    q = group_queries(query, key.shape[0]).to(key.dtype)
    n_kv, G, d = q.shape
    H = n_kv * G
    logits = torch.einsum("kgd,ktd->kgt", q, key) * scaling + bias[:, None, :].to(key.dtype)
    a = torch.softmax(logits, dim=-1)  # (H_kv, G, T)
    out = torch.einsum("kgt,ktd->kgd", a, value)
    m = tail_index.shape[1]
    a_t = torch.gather(a, 2, tail_index[:, None, :].expand(n_kv, G, m))  # (H_kv, G, m)
    v_t = torch.gather(value, 1, tail_index[:, :, None].expand(n_kv, m, d))  # (H_kv, m, d)
    z = None
    if fixed_size or gram is not None:
        z = a_t[..., None] * (v_t[:, None] - out[:, :, None, :])  # (H_kv, G, m, d)
    if fixed_size:
        w = tail_weight.to(z.dtype)[:, None, :, None]
        centre = (w * z).sum(2, keepdim=True) / w.sum(2, keepdim=True).clamp_min(1e-30)
        inflate = fixed_size_inflation(tail_weight, z.dtype)
        cert = (inflate[:, None] * (w * (z - centre) ** 2).sum((2, 3))).reshape(H)
    else:
        # Poisson: S2 - 2 o.S1 + |o|^2 S0 with S_k sums of (1-pi) a^2 |v|^k-type terms, i.e. two
        # matrix-vector products over the tail instead of an (H, m, d) residual tensor.
        wa2 = tail_weight.to(a_t.dtype)[:, None, :] * a_t * a_t  # (H_kv, G, m)
        s0 = wa2.sum(-1)
        s1 = torch.einsum("kgm,kmd->kgd", wa2, v_t)
        s2 = torch.einsum("kgm,km->kg", wa2, (v_t * v_t).sum(-1))
        cert = (s2 - 2 * (out * s1).sum(-1) + (out * out).sum(-1) * s0).clamp_min(0).reshape(H)
    layer_cert = None
    if gram is not None:
        u = z.permute(0, 2, 1, 3).reshape(n_kv, m, G * d)
        quad = (torch.bmm(u, gram.to(u.dtype)) * u).sum(-1)  # (H_kv, m)
        layer_cert = (tail_weight.to(quad.dtype) * quad).sum()
    return out.reshape(H, d), cert, layer_cert


class EvictionState(CaptureState):
    """Per-run state that enforces per-layer plans and records serving-time certificates.

    Parameters
    ----------
    prompt_length : int
        The first plans cover positions ``[0, prompt_length)``; later positions are kept until an
        event re-plans them.
    plans : dict of int to LayerPlan
        One plan per layer (a layer without a plan attends to the full cache).
    grams : dict of int to torch.Tensor, optional
        Per-layer ``(H_kv, G*d, G*d)`` Gram matrices for the output-space certificate.
    record_positions : iterable of int
        Query positions whose Q/outputs are recorded (as in :class:`CaptureState`).
    event_times : set of int
        Decode positions at which ``replan`` is called (decode-time eviction schedules).
    replan : callable, optional
        ``replan(tau) -> plans`` for the cache holding positions ``< tau``.
    one_pass : bool
        Compute certified decode steps' outputs and certificates in one pass (default); False
        runs SDPA and then the two-pass :func:`serving_certificates`.
    """

    def __init__(self, prompt_length: int, plans: dict[int, LayerPlan],
                 grams: dict[int, torch.Tensor] | None = None, record_positions=(), *,
                 event_times: set[int] | frozenset[int] = frozenset(),
                 replan: Callable[[int], dict[int, LayerPlan]] | None = None,
                 one_pass: bool = True) -> None:
        # Decode queries are recorded when later events need them for scoring.
        super().__init__(prompt_length, record_positions, bias_fn=self._bias,
                         record_from=prompt_length if replan is not None else None)
        self.plans = plans
        self.event_times = frozenset(int(t) for t in event_times)
        self.replan = replan
        # (event time, plans) of every event, the first at the end of prefill.
        self.history: list[tuple[int, dict[int, LayerPlan]]] = [(prompt_length, plans)]
        self.grams = grams or {}
        # Per decode step: {layer: (certificate_sq per head (H,), layer certificate_sq)}.
        self.certificates: list[dict[int, tuple[np.ndarray, float]]] = []
        self._step_certs: dict[int, tuple[np.ndarray, float]] = {}
        self.one_pass = bool(one_pass)
        # layer -> (plan, per-plan device tensors of the one-pass path)
        self._onepass_inputs: dict[int, tuple[LayerPlan, dict[str, torch.Tensor]]] = {}

    def begin_step(self, start: int, stop: int) -> None:
        if self._step_certs:
            self.certificates.append(self._step_certs)
        self._step_certs = {}
        if self.replan is not None and start in self.event_times and stop == start + 1:
            # Decode-time eviction: the cache holds positions < start; re-plan every layer.
            self.plans = self.replan(start)
            self.history.append((start, self.plans))
        super().begin_step(start, stop)

    def end(self) -> None:
        """Flush the last step's certificates."""
        if self._step_certs:
            self.certificates.append(self._step_certs)
            self._step_certs = {}

    def _bias(self, layer: int, positions: torch.Tensor, kv_len: int) -> torch.Tensor | None:
        plan = self.plans.get(layer)
        if plan is None or not plan.evicts:
            return None
        P = plan.bias.shape[1]
        bias = torch.zeros(plan.bias.shape[0], positions.numel(), kv_len, dtype=torch.float32)
        width = min(P, kv_len)
        bias[:, :, :width] = plan.bias[:, None, :width]
        return bias

    def _certified_step(self, layer: int, query: torch.Tensor, key: torch.Tensor
                        ) -> LayerPlan | None:
        plan = self.plans.get(layer)
        q_len, kv_len = query.shape[2], key.shape[2]
        if plan is None or not plan.certified or q_len != 1 or kv_len <= self.prompt_length:
            return None
        if not self.rule(layer).plain_logits:
            # decode_policy refuses this before decoding; a direct caller gets the same line.
            raise ValueError(f"layer {layer}: in-loop certificates of a layer with a soft-cap or "
                             "sinks are not implemented; use an uncertified policy")
        return plan

    def _windowed(self, layer: int, bias: torch.Tensor) -> torch.Tensor:
        """``bias`` ``(H_kv, kv_len)`` of a decode query at ``kv_len - 1``, with the keys before
        a sliding layer's window masked (the model's mask does the same on the SDPA path)."""
        window = self.rule(layer).window
        if window is None or bias.shape[1] <= window:
            return bias
        bias = bias.clone()
        bias[:, :bias.shape[1] - window] = float("-inf")
        return bias

    def _plan_inputs(self, layer: int, plan: LayerPlan, value: torch.Tensor
                     ) -> dict[str, torch.Tensor]:
        """Query-independent tensors of a plan, computed once on its first decode step:
        bias, tail weights ``1 - pi``, ``||v||^2`` and (output space) the pair forms."""
        cached = self._onepass_inputs.get(layer)
        if cached is not None and cached[0] is plan:
            return cached[1]
        dev = value.device
        P = plan.bias.shape[1]
        tail = plan.kept & (plan.pi < 1)
        weight = torch.where(tail, 1.0 - plan.pi, torch.zeros_like(plan.pi)).float().to(dev)
        v = value[:, :P].float()
        inputs = {"bias": plan.bias.to(dev), "weight": weight, "value_sq": (v * v).sum(-1)}
        gram = self.grams.get(layer)
        if gram is not None:
            inputs["gram"] = gram.to(dev)
            inputs["quad"] = pair_quadratic_forms(v, inputs["gram"], weight)
        self._onepass_inputs[layer] = (plan, inputs)
        return inputs

    def attend(self, layer, query, key, value, scaling):
        plan = self._certified_step(layer, query, key) if self.one_pass else None
        if plan is None:
            return None
        x = self._plan_inputs(layer, plan, value[0])
        pad = (0, key.shape[2] - x["bias"].shape[1])
        quad = x.get("quad")
        bias = self._windowed(layer, torch.nn.functional.pad(x["bias"], pad))
        with torch.no_grad():
            out, cert, layer_cert = onepass_attention(
                query[0, :, 0], key[0], value[0], bias,
                torch.nn.functional.pad(x["weight"], pad), float(scaling),
                value_sq=torch.nn.functional.pad(x["value_sq"], pad), gram=x.get("gram"),
                quad=None if quad is None else torch.nn.functional.pad(quad, pad),
                fixed_size=plan.fixed_size)
        self._step_certs[layer] = (cert.double().cpu().numpy(),
                                   float("nan") if layer_cert is None else float(layer_cert))
        return out.to(query.dtype)[None, None]

    def record(self, layer, query, key, value, output, mask, scaling) -> None:
        super().record(layer, query, key, value, output, mask, scaling)
        plan = self._certified_step(layer, query, key)
        if plan is None or layer in self._step_certs:
            return  # not certified, or attend() already did it in one pass
        kv_len = key.shape[2]
        P = plan.bias.shape[1]
        dev = key.device
        bias = self._windowed(layer,
                              torch.nn.functional.pad(plan.bias.to(dev), (0, kv_len - P)))
        with torch.no_grad():
            _, cert, layer_cert = serving_certificates(
                query[0, :, 0].float(), key[0].float(), value[0].float(), bias,
                plan.tail_index.to(dev), plan.tail_weight.to(dev), float(scaling),
                self.grams.get(layer), plan.fixed_size)
        self._step_certs[layer] = (cert.double().cpu().numpy(),
                                   float("nan") if layer_cert is None else float(layer_cert))
