"""In-loop fetches: enforcing a tiers scheduler's page fetches inside the model.

:class:`FetchState` is an :class:`~tracesim.capture.inloop.enforce.EvictionState` that, at every
decode
step and
layer, decides which evicted pages to bring back and then computes the step's attention with
them. The decision uses what a server has at that step — the step's query, the retained cache,
the sampled tail's certificate terms and the page summaries of the evicted tokens — through the
offline simulator's own compiled step (:mod:`tracesim.tiers.step`): pages in priority order,
whole, until the byte budget (a fraction of the layer's evicted bytes) is spent. A fetched
page's tokens all get bias 0 for that step (the evicted ones return, the sampled ones lose
their ``-log pi`` offset and leave the certificate's tail); the next step starts again from the
base eviction.

A step that fetches nothing runs exactly the plain eviction path (so a budget of 0, or the
``none`` scheduler, reproduces ``tracesim evict`` bit for bit); a step that fetches runs the
one-pass attention (:func:`tracesim.capture.inloop.onepass.onepass_attention`) with the modified
bias, and
certificates (when the base policy has them) from the modified tail weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tracesim.capture.inloop.enforce import EvictionState, LayerPlan
from tracesim.capture.inloop.onepass import onepass_attention

from tracesim.tiers.model import MemoryModel
from tracesim.tiers.schedulers import get_scheduler, scheduler_names
from tracesim.tiers.step import (
    LayerFetch,
    StepFetch,
    inloop_schedulers,
    layer_fetch,
    layer_memory_model,
    step_fetch,
)

__all__ = ["FetchConfig", "FetchState", "fetch_columns"]


@dataclass(frozen=True)
class FetchConfig:
    """One fetch configuration of an in-loop run.

    Parameters
    ----------
    scheduler : str
        One of :func:`tracesim.tiers.step.inloop_schedulers`: a built-in, or a plugin
        scheduler (entry point or :func:`tracesim.tiers.register_scheduler`) with ``in_loop``.
    budget : float
        Bytes fetched per (decode step, layer), as a fraction in [0, 1] of the layer's evicted
        bytes; 1 fetches every evicted page.
    memory : MemoryModel
        Page size, bytes per element and tiers (``tiers.yaml``'s ``memory``).
    """

    scheduler: str
    budget: float
    memory: MemoryModel = MemoryModel()

    def __post_init__(self) -> None:
        # a known name is loaded (a broken plugin raises its own error), an unknown one is not
        if not (self.scheduler in scheduler_names() and get_scheduler(self.scheduler).in_loop):
            raise ValueError(f"--fetch: unknown scheduler {self.scheduler!r}; expected some of "
                             f"{list(inloop_schedulers())}"
                             + (" (confidence is offline only: its per-step budgets are "
                                "normalised over the whole sequence's log-probs)"
                                if self.scheduler == "confidence" else ""))
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b <= 1:
            raise ValueError(f"--fetch-budget {b!r}: expected fractions in [0, 1] of the "
                             "layer's evicted bytes")

    def row(self) -> dict[str, Any]:
        return {"fetch_scheduler": self.scheduler, "fetch_budget": float(self.budget),
                "fetch_page": int(self.memory.page)}


#: Bytes of float64 host copies of the layers' caches that a run keeps between decode steps
#: (all layers together). Within it each position is converted once; beyond it (large models,
#: long contexts) every step converts its layer's cache afresh and drops the copy.
HOST_COPY_BYTES = 2 << 30


@dataclass
class _HostLayer:
    """Float64 host copies of one layer's cache and plan (generated positions are take-all:
    ``pi = 1``, kept); ``keys``/``values`` hold positions ``< n`` and may be released."""

    plan: LayerPlan
    keys: np.ndarray     # (n_kv, capacity, d)
    values: np.ndarray   # (n_kv, capacity, d)
    pi: np.ndarray       # (n_kv, capacity)
    kept: np.ndarray     # (n_kv, capacity)
    n: int               # positions copied so far
    pages: LayerFetch | None = None

    def reserve(self, T: int) -> None:
        """Room for ``T`` positions (in chunks, so that decode steps rarely reallocate)."""
        n_kv, _, d = self.keys.shape
        if self.pi.shape[1] < T:
            old = self.pi.shape[1]
            pi, kept = np.ones((n_kv, T + 256)), np.ones((n_kv, T + 256), dtype=np.bool_)
            pi[:, :old], kept[:, :old] = self.pi, self.kept
            self.pi, self.kept = pi, kept
        if self.keys.shape[1] < T:
            cap = self.pi.shape[1]
            keys, values = np.empty((n_kv, cap, d)), np.empty((n_kv, cap, d))
            keys[:, :self.n], values[:, :self.n] = self.keys[:, :self.n], self.values[:, :self.n]
            self.keys, self.values = keys, values

    def release(self) -> None:
        """Drop the cache copies (the plan's pages, pi and kept stay)."""
        n_kv, _, d = self.keys.shape
        self.keys, self.values, self.n = np.empty((n_kv, 0, d)), np.empty((n_kv, 0, d)), 0


class FetchState(EvictionState):
    """:class:`EvictionState` that enforces a fetch scheduler at every decode step.

    Parameters
    ----------
    prompt_length, plans, grams
        As for :class:`EvictionState` (one-shot plans only).
    fetch : FetchConfig
    seed : int
        Seed of the base policy (keys the ``random`` scheduler's permanent uniforms).
    n_layers : int
        Layers of the model (each gets a 1 / n_layers share of every tier's capacity).

    Attributes
    ----------
    fetch_log : list of (step, layer, StepFetch)
        One entry per decode step and layer with an evicting plan; ``step`` counts decode
        steps from 0 (query position ``prompt_length + step``).
    """

    def __init__(self, prompt_length: int, plans: dict[int, LayerPlan],
                 grams: dict[int, torch.Tensor] | None, *, fetch: FetchConfig, seed: int,
                 n_layers: int) -> None:
        super().__init__(prompt_length, plans, grams)
        self.fetch = fetch
        self.seed = int(seed)
        self.memory = layer_memory_model(fetch.memory, n_layers)
        self.fetch_log: list[tuple[int, int, StepFetch]] = []
        self._host: dict[int, _HostLayer] = {}
        self._keep_host: bool | None = None  # decided on the first step (cache size known)

    def _host_layer(self, layer: int, plan: LayerPlan, key: torch.Tensor,
                    value: torch.Tensor) -> _HostLayer:
        """The layer's float64 host state. A decode step only appends to the cache, so while
        the copies fit in :data:`HOST_COPY_BYTES` only its new positions are converted; the
        plan's pages are built on its first step."""
        n_kv, T, d = key.shape
        if self._keep_host is None:
            evicting = sum(1 for p in self.plans.values() if p.evicts)
            self._keep_host = evicting * 2 * n_kv * (T + 256) * d * 8 <= HOST_COPY_BYTES
        h = self._host.get(layer)
        if h is None or h.plan is not plan:
            P = plan.kept.shape[1]
            h = _HostLayer(plan, np.empty((n_kv, 0, d)), np.empty((n_kv, 0, d)),
                           np.empty((n_kv, 0)), np.empty((n_kv, 0), dtype=np.bool_), 0)
            h.reserve(T)
            h.pi[:, :P] = plan.pi.numpy()
            h.kept[:, :P] = plan.kept.numpy()
            self._host[layer] = h
        h.reserve(T)
        if h.n < T:
            h.keys[:, h.n:T] = key[:, h.n:T].double().cpu().numpy()
            h.values[:, h.n:T] = value[:, h.n:T].double().cpu().numpy()
            h.n = T
        if h.pages is None:
            P = plan.kept.shape[1]
            h.pages = layer_fetch(h.keys[:, :P], h.values[:, :P], h.pi[:, :P], h.kept[:, :P],
                                  self.memory, hajek=plan.hajek, certified=plan.certified)
        return h

    def attend(self, layer, query, key, value, scaling):
        plan = self.plans.get(layer)
        q_len, kv_len = query.shape[2], key.shape[2]
        if plan is None or not plan.evicts or q_len != 1 or kv_len <= self.prompt_length:
            return super().attend(layer, query, key, value, scaling)
        h = self._host_layer(layer, plan, key[0], value[0])
        step = kv_len - 1 - self.prompt_length
        f = step_fetch(h.pages, self.fetch.scheduler, float(self.fetch.budget),
                       query[0, :, 0].double().cpu().numpy(), h.keys, h.values, h.pi, h.kept,
                       kv_len, float(scaling), seed=self.seed, layer=layer, step=step)
        if not self._keep_host:
            h.release()
        self.fetch_log.append((step, layer, f))
        if f.pages_fetched == 0:
            return super().attend(layer, query, key, value, scaling)
        return self._attend_fetched(layer, plan, f, query, key, value, scaling)

    def _attend_fetched(self, layer, plan, f: StepFetch, query, key, value, scaling):
        x = self._plan_inputs(layer, plan, value[0])
        dev = key.device
        P = plan.bias.shape[1]
        page = self.memory.page
        blocks = np.zeros((len(f.pages), -(-P // page)), dtype=np.bool_)
        for g, ids in enumerate(f.pages):
            blocks[g, ids] = True
        open_ = torch.from_numpy(np.repeat(blocks, page, axis=1)[:, :P]).to(dev)
        bias = torch.where(open_, torch.zeros_like(x["bias"]), x["bias"])
        pad = (0, key.shape[2] - P)
        weight = None
        if plan.certified:
            weight = torch.nn.functional.pad(
                torch.where(open_, torch.zeros_like(x["weight"]), x["weight"]), pad)
        quad = x.get("quad") if plan.certified else None
        with torch.no_grad():
            out, cert, layer_cert = onepass_attention(
                query[0, :, 0], key[0], value[0], torch.nn.functional.pad(bias, pad),
                weight, float(scaling),
                value_sq=torch.nn.functional.pad(x["value_sq"], pad),
                gram=x.get("gram") if plan.certified else None,
                quad=None if quad is None else torch.nn.functional.pad(quad, pad),
                fixed_size=plan.fixed_size)
        if plan.certified:
            self._step_certs[layer] = (cert.double().cpu().numpy(),
                                       float("nan") if layer_cert is None else float(layer_cert))
        return out.to(query.dtype)[None, None]


def fetch_columns(fetch: FetchConfig | None, log: list[tuple[int, int, StepFetch]]
                  ) -> dict[str, Any]:
    """Outcome columns of a run's fetches, summed over its decode steps and layers.

    All null (None) without a fetch configuration (a policy that evicts nothing).
    """
    keys = ("fetch_scheduler", "fetch_budget", "fetch_page", "fetch_bytes", "fetch_pages",
            "fetch_evicted_bytes", "fetch_bytes_share", "fetch_ms", "fetch_stall_ms")
    if fetch is None:
        return dict.fromkeys(keys)
    moved = float(sum(f.bytes_moved for _, _, f in log))
    evicted = float(sum(f.evicted_bytes for _, _, f in log))
    return {
        **fetch.row(),
        "fetch_bytes": moved,
        "fetch_pages": float(sum(f.pages_fetched for _, _, f in log)),
        "fetch_evicted_bytes": evicted,
        "fetch_bytes_share": moved / evicted if evicted > 0 else math.nan,
        "fetch_ms": float(sum(f.fetch_s for _, _, f in log)) * 1e3,
        "fetch_stall_ms": float(sum(f.stall_s for _, _, f in log)) * 1e3,
    }
