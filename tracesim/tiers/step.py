"""One decode step of one layer, one scheduler: the pages an in-loop fetch brings back.

The offline simulator (:mod:`tracesim.tiers.simulate`) evaluates every scheduler and budget at
once over a stored layer. The in-loop fetch (``tracesim evict --fetch``,
:mod:`tracesim.capture.inloop.fetch`)
needs the same decision one step at a time, inside the model, for the scheduler it enforces.
It runs the simulator's own compiled step (:func:`tracesim.kernels.tiers.tiers_layer`, with
the step's query as the only query) over the run's cache, so the two apply one set of rules
(``docs/tiers.md``, :mod:`tracesim.tiers.schedulers`):

* pages: per KV head, the evicted positions of the plan grouped into pages of ``memory.page``
  positions, summarised as :func:`tracesim.bounds.pages.build_page_summaries` does; bytes
  ``2 d bytes_per_element`` per evicted token; placement in the lower tiers in (KV head,
  position) order with a 1 / n_layers share of each tier's capacity;
* priorities: those of :mod:`tracesim.tiers.schedulers` (``random`` keyed by the decode step);
* selection: pages in decreasing priority (stable), whole, until the byte budget
  ``f x`` (the layer's evicted bytes) is spent; ``f >= 1`` fetches every page.

Only the page summaries of evicted tokens enter the deployable priorities (``bound``,
``certificate*``); the evicted keys themselves are read by ``oracle`` alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracesim.kernels.tiers import Attention, Inclusion, Pages, tiers_layer
from tracesim.tiers.model import MemoryModel
from tracesim.tiers.schedulers import (
    BUILTIN_SCHEDULERS,
    get_scheduler,
    kernel_schedule,
    scheduler_names,
)
from tracesim.tiers.simulate import (
    kernel_pages,
    layer_memory_model,
    modelled_times,
    random_priorities,
    tail_positions,
)

__all__ = ["INLOOP_SCHEDULERS", "LayerFetch", "StepFetch", "inloop_schedulers", "layer_fetch",
           "layer_memory_model", "step_fetch"]

#: Built-in schedulers the in-loop fetch enforces (``confidence`` needs the whole sequence's
#: log-probs to normalise its per-step budgets, which a decode loop does not have).
INLOOP_SCHEDULERS = tuple(n for n, s in BUILTIN_SCHEDULERS.items() if s.in_loop)


def inloop_schedulers() -> tuple[str, ...]:
    """Every scheduler the in-loop fetch enforces: :data:`INLOOP_SCHEDULERS`, then the
    registered and entry-point schedulers whose ``in_loop`` is true (an entry point is loaded
    to read it)."""
    plugins = tuple(n for n in scheduler_names() if n not in BUILTIN_SCHEDULERS
                    and get_scheduler(n).in_loop)
    return INLOOP_SCHEDULERS + plugins


@dataclass(frozen=True)
class LayerFetch:
    """What a one-shot plan fixes for a whole decode: the evicted pages of every KV head of one
    layer, in the form :func:`tracesim.kernels.tiers.tiers_layer` takes them.

    Attributes
    ----------
    memory : MemoryModel
        The layer's model (:func:`layer_memory_model`).
    pages : Pages
        The pages, their summaries and the block -> page map.
    tail_off, tail_pos : ndarray of int64
        The sampled kept positions of each KV head.
    hajek, certified : bool
        The base policy's correction and whether it carries certificates.
    """

    memory: MemoryModel
    pages: Pages
    tail_off: np.ndarray
    tail_pos: np.ndarray
    hajek: bool
    certified: bool

    @property
    def n_pages(self) -> int:
        return int(self.pages.off[-1])


def layer_fetch(keys: np.ndarray, values: np.ndarray, pi: np.ndarray, kept: np.ndarray,
                memory: MemoryModel, *, hajek: bool, certified: bool) -> LayerFetch:
    """The pages of the tokens a plan evicts.

    Parameters
    ----------
    keys, values : ndarray of float64, shape (n_kv, P, d)
        Post-RoPE keys and values of the planned (prompt) positions.
    pi : ndarray of float64, shape (n_kv, P)
    kept : ndarray of bool, shape (n_kv, P)
    memory : MemoryModel
        The *layer's* model (:func:`layer_memory_model`).
    hajek, certified : bool
    """
    kept = np.ascontiguousarray(kept, dtype=np.bool_)
    pages = kernel_pages(keys, values, kept, memory.page, memory.token_bytes(keys.shape[2]),
                         memory)
    tail_off, tail_pos = tail_positions(np.asarray(pi, dtype=np.float64), kept)
    return LayerFetch(memory, pages, tail_off, tail_pos, bool(hajek), bool(certified))


@dataclass(frozen=True)
class StepFetch:
    """The fetches of one (decode step, layer).

    Attributes
    ----------
    pages : list of ndarray of int64
        Page indices (position // page) fetched per KV head, ascending.
    bytes_moved, pages_fetched : float
        Bytes and pages fetched by the layer at this step.
    evicted_bytes : float
        Bytes of every evicted page of the layer (what refetching all would move).
    fetch_s, stall_s : float
        Modelled fetch time and stall (seconds), :meth:`MemoryModel.step_times`.
    tier_bytes : ndarray, shape (n_tiers,)
        Bytes fetched from each lower tier.
    """

    pages: list[np.ndarray]
    bytes_moved: float
    pages_fetched: float
    evicted_bytes: float
    fetch_s: float
    stall_s: float
    tier_bytes: np.ndarray


def step_fetch(lf: LayerFetch, scheduler: str, budget: float, query: np.ndarray,
               keys: np.ndarray, values: np.ndarray, pi: np.ndarray, kept: np.ndarray,
               n_positions: int, scale: float, *, seed: int, layer: int,
               step: int) -> StepFetch:
    """Choose one step's pages and account for them with the layer's memory model.

    Parameters
    ----------
    lf : LayerFetch
    scheduler : str
        One of :func:`inloop_schedulers` (a built-in or a plugin with ``in_loop``).
    budget : float
        Bytes fetched, as a fraction of the layer's evicted bytes.
    query : ndarray of float64, shape (H, d)
        The step's query of every query head.
    keys, values : ndarray of float64, C-contiguous, shape (n_kv, >= n_positions, d)
        The cache; positions ``0..n_positions-1`` are read (the query is at the last).
    pi : ndarray of float64, shape (n_kv, >= n_positions)
        Inclusion probabilities (1 for take-all and generated tokens).
    kept : ndarray of bool, shape (n_kv, >= n_positions)
    n_positions : int
    scale : float
        Softmax scale.
    seed, layer, step : int
        Keys of the permanent uniforms of ``random`` (``step`` counts decode steps from 0).
    """
    n_kv = keys.shape[0]
    pages, page, memory = lf.pages, lf.memory.page, lf.memory
    n_tiers = len(memory.lower)
    t = int(n_positions) - 1
    rule = get_scheduler(scheduler)
    if not rule.fetches or lf.n_pages == 0:
        sel = np.zeros(0, dtype=np.int64)
        nf, nb = np.zeros(n_tiers), np.zeros(n_tiers)
        kept_tokens = float(np.count_nonzero(kept[:, :t + 1]))
    else:
        rprio = (random_priorities(int(seed), int(layer), pages, np.array([step]))
                 if rule.needs_uniforms else np.zeros((1, 1)))
        sched, plugin = kernel_schedule((scheduler,), np.array([float(budget)]), np.ones(1),
                                        rprio)
        r = tiers_layer(Attention(keys, values,
                                  np.ascontiguousarray(query[:, None, :], dtype=np.float64),
                                  np.array([t], dtype=np.int64), float(scale)),
                        Inclusion(pi, kept, lf.hajek, lf.certified, lf.tail_off, lf.tail_pos),
                        pages, sched, n_tiers, want_order=True, plugin=plugin)
        sel = r["order"][0, 0, :r["nsel"][0, 0, 0]]
        nf, nb = r["tier_nf"][0, 0, 0], r["tier_nb"][0, 0, 0]
        kept_tokens = float(r["kept_tokens"][0])
    off = pages.off
    per_head = [np.sort(pages.first[sel[(sel >= off[g]) & (sel < off[g + 1])]] // page)
                for g in range(n_kv)]
    fs, st = modelled_times(memory, nf, nb, np.float64(kept_tokens),
                            memory.token_bytes(keys.shape[2]))
    return StepFetch(per_head, float(nb.sum()), float(sel.size), float(pages.nbytes.sum()),
                     float(fs), float(st), nb)
