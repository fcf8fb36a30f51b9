"""Fetch schedulers: which evicted pages to bring back at one decode step of one layer.

The table of schedulers is :data:`tracesim.registry.SCHEDULER_REGISTRY`: the
:data:`BUILTIN_SCHEDULERS`, those an installed distribution declares under the entry-point group
``tracesim.schedulers`` (every process finds them: ``tracesim tiers``, its Dask workers and the
in-loop fetch) and those added with :func:`register_scheduler` for this process only
(``docs/extending.md``, "A new fetch scheduler"). Each entry is a
:class:`Scheduler`: a name, what it reads, and its priority rule as a numba-compilable function
of :class:`~tracesim.kernels.tier_priorities.PageInputs` (the kernel's) and as a numpy function
of the same inputs as arrays (the reference's). The built-in rules are in
:mod:`tracesim.kernels.tier_priorities`.

Each scheduler turns what it may know at a step into a *priority* for every evicted page of
every KV head of the layer; the simulator then fetches pages in decreasing priority until the
step's byte budget is spent. All but ``oracle`` use only what a server has at that step.

* ``none``: nothing is fetched.
* ``random``: a permanent uniform per (seed, layer, KV head, step, page), stream 2.
* ``confidence``: random order; the step's byte budget is scaled by ``1 - exp(logprob)`` of the
  token the step reads (the last generated token), normalised so the budgets average to the
  others' over the sequence.
* ``certificate``: the KV head's certificate (sum over its query heads of ``tr V_hat``) times
  the page's share of the head's page bound (below). Needs a certified base policy.
* ``certificate_page``: the page's share of the certificate, i.e. the terms
  ``(1 - pi_i) a_i^2 |v_i - o_hat|^2`` of its *sampled* tokens summed over the group's query
  heads; pages without a sampled token follow in the ``certificate`` order. Needs a certified
  base policy.
* ``certificate_bound``: the page's share of the layer's certificate (its ``certificate_page``
  terms over their sum over every KV head of the layer) plus its share of the layer's page
  bound (its ``bound`` term over their sum). Needs a certified base policy.
* ``bound``: the page's term of the deterministic bound, summed over the group's query heads,
  ``n_p exp(u_p) (|c_p - o_R| + r_p) / E_R``.
* ``oracle`` (not deployable): the softmax mass the page adds when fetched, summed over the
  group's heads: its evicted tokens' true attention mass less ``(1/pi - 1)`` times the mass of
  its sampled tokens, whose Hájek weight already stood in for the page.

``u_p`` is the page's logit upper bound from its key summaries (``tracesim.bounds.pages``),
``c_p``, ``r_p`` its value centroid and radius, ``o_R`` and ``E_R`` the kept tokens' softmax
average and mass, all measured relative to the largest kept logit.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracesim.kernels import tier_priorities as tp
from tracesim.kernels.tier_args import SchedulerTable
from tracesim.kernels.tier_priorities import PageInputs
from tracesim.prn import permanent_uniforms
from tracesim.registry import SCHEDULER_REGISTRY

__all__ = ["BOUND_SCHEDULERS", "BUILTIN_SCHEDULERS", "CERTIFIED_SCHEDULERS", "DEPLOYABLE",
           "SCHEDULERS", "STREAM_FETCH", "PageInputs", "Scheduler", "confidence_weights",
           "get_scheduler", "in_process_schedulers", "kernel_schedule", "random_priority",
           "register_scheduler", "scheduler_names", "scheduler_source_hash"]

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,47}$")


@dataclass(frozen=True)
class Scheduler:
    """One fetch scheduler: its name, what it reads, and its priority rule twice.

    Pages are fetched in decreasing priority (ties in page order) until the step's byte budget
    is spent.

    Parameters
    ----------
    name : str
        What specs and results call it (lower case letters, digits and ``_``).
    priority : callable
        The rule for the kernel: a numba-compilable function (``@numba.njit`` or plain) of one
        :class:`PageInputs` of scalars, returning the page's priority (float).
    reference : callable
        The same rule in numpy for :func:`tracesim.tiers.reference.simulate_layer_reference`:
        a function of one :class:`PageInputs` whose per-page fields are arrays of shape (NP,),
        returning the priorities, shape (NP,).
    deployable : bool, default True
        False for a rule that reads what a server does not have (``oracle_mass``).
    needs_certificate : bool, default False
        Reads ``page_cert``, ``head_cert`` or ``layer_cert``: refuses an uncertified base
        policy.
    needs_bound : bool, default False
        Reads ``bound``, ``head_bound`` or ``layer_bound`` (computed only when some scheduler
        of the run needs them).
    needs_uniforms : bool, default False
        Reads ``uniform``.
    fetches : bool, default True
        False for ``none`` alone (fetches nothing; ``priority`` is never called).
    scaled_budget : bool, default False
        The step's byte budget is multiplied by the ``confidence`` weights.
    in_loop : bool, default True
        ``tracesim evict --fetch`` can enforce it (``confidence`` needs the whole sequence).
    """

    name: str
    priority: Callable[[PageInputs], float]
    reference: Callable[[PageInputs], np.ndarray]
    deployable: bool = True
    needs_certificate: bool = False
    needs_bound: bool = False
    needs_uniforms: bool = False
    fetches: bool = True
    scaled_budget: bool = False
    in_loop: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"Scheduler.name = {self.name!r}: expected lower case letters, "
                             "digits and _ (at most 48, starting with a letter)")
        for field in ("priority", "reference"):
            if not callable(getattr(self, field)):
                raise ValueError(f"Scheduler {self.name!r}: {field} = "
                                 f"{getattr(self, field)!r}: expected a function of PageInputs")
        for field in ("deployable", "needs_certificate", "needs_bound", "needs_uniforms",
                      "fetches", "scaled_budget", "in_loop"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"Scheduler {self.name!r}: {field} = "
                                 f"{getattr(self, field)!r}: expected a bool")


def _builtin(name: str, rule: str, **flags: Any) -> Scheduler:
    return Scheduler(name, getattr(tp, f"{rule}_priority"), getattr(tp, f"{rule}_reference"),
                     **flags)


#: The built-in schedulers in code order (``tracesim.kernels.tier_priorities.S_*``).
BUILTIN_SCHEDULERS: dict[str, Scheduler] = {s.name: s for s in (
    Scheduler("none", tp.uniform_priority, tp.uniform_reference, fetches=False),
    _builtin("random", "uniform", needs_uniforms=True),
    _builtin("confidence", "uniform", needs_uniforms=True, scaled_budget=True, in_loop=False),
    _builtin("certificate", "certificate", needs_certificate=True, needs_bound=True),
    _builtin("certificate_page", "certificate_page", needs_certificate=True,
             needs_bound=True),
    _builtin("bound", "bound", needs_bound=True),
    _builtin("oracle", "oracle", deployable=False),
    _builtin("certificate_bound", "certificate_bound", needs_certificate=True,
             needs_bound=True),
)}
SCHEDULER_REGISTRY.install(BUILTIN_SCHEDULERS, Scheduler)

SCHEDULERS = tuple(BUILTIN_SCHEDULERS)
DEPLOYABLE = {s: BUILTIN_SCHEDULERS[s].deployable for s in SCHEDULERS}
#: Built-in schedulers that read the certificate, so need a certified base policy.
CERTIFIED_SCHEDULERS = frozenset(s for s in SCHEDULERS if BUILTIN_SCHEDULERS[s].needs_certificate)
#: Built-in schedulers that read the page bound.
BOUND_SCHEDULERS = frozenset(s for s in SCHEDULERS if BUILTIN_SCHEDULERS[s].needs_bound)
#: Permanent-random-number stream of fetch orders (0: inclusion, 1: score perturbations).
STREAM_FETCH = 2


def register_scheduler(scheduler: Scheduler) -> Scheduler:
    """Add a scheduler to this process's table, so specs and :func:`tracesim.tiers.run_tiers`
    (local backend) can name it; returns it. A scheduler that Dask workers should find is
    declared under the entry-point group ``tracesim.schedulers`` instead.

    Raises
    ------
    ValueError
        If it is not a :class:`Scheduler` or its name is a built-in's. Registering a name
        again replaces the earlier entry (a module imported twice, a notebook cell rerun).
    """
    if not isinstance(scheduler, Scheduler):
        raise ValueError(f"register_scheduler({scheduler!r}): expected a Scheduler")
    if scheduler.name in BUILTIN_SCHEDULERS:
        raise ValueError(f"scheduler name {scheduler.name!r} is a built-in's; choose another")
    return SCHEDULER_REGISTRY.register(scheduler)


def scheduler_names() -> tuple[str, ...]:
    """Every scheduler a spec may name: the built-ins, the registered ones, the entry points."""
    return tuple(SCHEDULER_REGISTRY.names())


def get_scheduler(name: str) -> Scheduler:
    """The table's entry for ``name``; ``ValueError`` naming the choices if there is none (or
    naming the plugin when its entry point fails to load)."""
    try:
        return SCHEDULER_REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown scheduler {name!r}; expected one of "
                         f"{list(scheduler_names())}") from None


def scheduler_source_hash(name: str) -> str:
    """``sha256:<hex>`` of the source files defining a scheduler's two rules, as on disk now
    (:func:`tracesim.registry.functions_hash`)."""
    return SCHEDULER_REGISTRY.digest(get_scheduler(name))


def in_process_schedulers(names: Iterable[str]) -> list[str]:
    """Those of ``names`` registered by :func:`register_scheduler` only: other processes (Dask
    workers) cannot find them."""
    return [n for n in names if n in SCHEDULER_REGISTRY.registered]


def kernel_schedule(names: Iterable[str], budgets: np.ndarray, conf_w: np.ndarray,
                    rprio: np.ndarray) -> tuple[SchedulerTable, Any]:
    """The kernel's :class:`~tracesim.kernels.tier_args.SchedulerTable` of the named schedulers and
    the callback of their registered rules (:func:`tracesim.kernels.tier_priorities.
    plugin_priority`).

    ``budgets`` (NB,) and ``conf_w`` (NQ,) as the kernel takes them; ``rprio`` (NQ, NP) the
    pages' permanent uniforms, read when some scheduler ``needs_uniforms``.
    """
    table = [get_scheduler(n) for n in names]
    rules: list[Callable[[PageInputs], float]] = []
    codes = []
    for s in table:
        if s.name in BUILTIN_SCHEDULERS:
            codes.append(SCHEDULERS.index(s.name))
        else:
            codes.append(tp.N_BUILTIN + len(rules))
            rules.append(s.priority)
    sched = SchedulerTable(
        codes=np.array(codes, dtype=np.int64),
        fetches=np.array([s.fetches for s in table], dtype=np.bool_),
        scaled=np.array([s.scaled_budget for s in table], dtype=np.bool_),
        budgets=budgets, conf_w=conf_w, rprio=rprio,
        need_bound=any(s.needs_bound for s in table),
        need_uniforms=any(s.needs_uniforms for s in table))
    return sched, tp.plugin_priority(tuple(rules))


def random_priority(seed: int, layer: int, kv_head: int, step: int,
                    pages: np.ndarray) -> np.ndarray:
    """Permanent uniforms ordering the pages of one KV head at one step, shape (n_pages,)."""
    key = (np.int64(step) * 65537 + np.asarray(pages, dtype=np.int64)) % (1 << 32)
    return permanent_uniforms(int(seed), int(layer), int(kv_head), key, stream=STREAM_FETCH)


def confidence_weights(logprobs: np.ndarray) -> np.ndarray:
    """Per-step budget multipliers from the log-probs of the tokens the steps read.

    ``w = 1 - exp(logprob)`` (the chance the token just generated was not the model's sure
    pick), normalised to mean 1 over the steps; all-certain steps give uniform weights.

    Parameters
    ----------
    logprobs : ndarray, shape (n_steps,)
        Log-probabilities (<= 0); NaN where unknown (treated as the mean).

    Returns
    -------
    ndarray, shape (n_steps,)
    """
    lp = np.asarray(logprobs, dtype=np.float64)
    w = 1.0 - np.exp(np.minimum(lp, 0.0))
    if np.isnan(w).all():
        return np.ones(lp.size)
    w = np.where(np.isnan(w), np.nanmean(w), w)
    total = w.sum()
    return np.ones(lp.size) if total <= 0 else w * (w.size / total)
