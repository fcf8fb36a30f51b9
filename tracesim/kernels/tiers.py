"""Compiled simulator of fetch schedulers over one layer and seed (``tracesim tiers``).

One call simulates every evaluated decode step of one layer for one seed of the base policy.
The unit of work is the decode step: the steps are independent and run in parallel
(``prange``), while everything inside a step (its KV heads, schedulers and budgets) runs in a
fixed order, so the results do not depend on the number of threads.

Per step and KV head it makes two passes over the visible positions ``0..t``: the logits of the
group's query heads (keys), then one pass over the values that accumulates the full-cache
output, the base estimate's numerator and normaliser (Hájek weights ``1/pi`` on the kept
tokens, or 1), the kept tokens' softmax average and mass (for the page bound), and the
attention mass of every evicted page (with the Hájek adjustment of its sampled tokens). The
sampled (``pi < 1``) kept tokens then give the certificate and its per-page share. The value
sums of a page are never stored: once a scheduler has ordered the pages, the budgets are
processed from the smallest to the largest, each adding the pages it newly fetches from their
tokens, and a KV head whose every evicted page is fetched is the full cache.

The arguments come in five named tuples (:mod:`tracesim.kernels.tier_args`, each field's shape
documented there once): :class:`Attention`, :class:`Inclusion`, :class:`Pages`,
:class:`SchedulerTable` and :class:`TierOutputs`. Each scheduler's priority of a page is a
function of the page's :class:`~tracesim.kernels.tier_priorities.PageInputs`: built-in rules are
compiled in (``builtin_priority``), registered ones arrive as one C callback (``plugin_priority``).

The step itself is :func:`tracesim.kernels.tier_step.tiers_step` and its per-KV-head passes
(logits, the value pass, a fetched page's tokens) are in :mod:`tracesim.kernels.tier_passes`;
this module holds the serial and parallel layer drivers and the entry point
:func:`tiers_layer`.

The plain-numpy reference, which the tests compare this kernel with, is
:func:`tracesim.tiers.reference.simulate_layer_reference`; the definitions are in
``docs/tiers.md`` and :mod:`tracesim.tiers.schedulers`.
"""

from __future__ import annotations

from typing import Any

import numba as nb
import numpy as np

from tracesim.kernels.tier_args import Attention, Inclusion, Pages, SchedulerTable, TierOutputs
from tracesim.kernels.tier_priorities import (  # noqa: F401 - the codes are re-exported
    N_BUILTIN,
    S_BOUND,
    S_CERTIFICATE,
    S_CERTIFICATE_BOUND,
    S_CERTIFICATE_PAGE,
    S_CONFIDENCE,
    S_NONE,
    S_ORACLE,
    S_RANDOM,
    PageInputs,
    builtin_priority,
    plugin_priority,
    quiet_first_class_functions,
)
from tracesim.kernels.tier_step import tiers_step

__all__ = ["Attention", "Inclusion", "Pages", "SchedulerTable", "TierOutputs", "tiers_layer",
           "tiers_step"]

#: Layers whose work (multiply-adds over steps x positions x query heads x head dim) is below
#: this run serially: a parallel region costs more than it saves on tiny layers.
SERIAL_BELOW = 1 << 22


@nb.njit(cache=True, parallel=True)
def _layer_parallel(att, inc, pages, schedule, out, plugin):
    # not called ``sched``: numba's parallel loop gives that name to its own work schedule
    for a in nb.prange(att.qpos.size):
        # an int64 step index, so the serial and parallel kernels share one compiled step
        step = np.int64(a)
        tiers_step(step, att, inc, pages, schedule, out, plugin)


@nb.njit(cache=True)
def _layer_serial(att, inc, pages, schedule, out, plugin):
    for a in range(att.qpos.size):
        tiers_step(a, att, inc, pages, schedule, out, plugin)


def tiers_layer(att: Attention, inc: Inclusion, pages: Pages, schedule: SchedulerTable,
                n_tiers: int, want_order: bool = False,
                plugin: Any = None) -> dict[str, np.ndarray]:
    """Simulate every decode step of one layer for one seed.

    Parameters
    ----------
    att : Attention
        Keys, values, the evaluated decode queries, their positions and the softmax scale.
    inc : Inclusion
        The base policy's inclusion probabilities and kept set.
    pages : Pages
        The evicted pages and their summaries.
    schedule : SchedulerTable
        Schedulers, fetch budgets and what the schedulers read.
    n_tiers : int
        Lower tiers.
    want_order : bool
        Also return each scheduler's fetch order (``order``).
    plugin : numba.cfunc, optional
        The callback of the registered rules among ``schedule.codes``
        (:func:`tracesim.kernels.tier_priorities.plugin_priority`); none by default.

    Returns
    -------
    dict of str -> ndarray
        The fields of :class:`TierOutputs` by name (shapes documented there).
    """
    n_kv = att.K.shape[0]
    H, NQ, d = att.Q.shape[0], att.qpos.size, att.K.shape[2]
    NS, NB = schedule.codes.size, schedule.budgets.size
    out = TierOutputs(
        err_before=np.zeros((H, NQ)), cert=np.zeros((H, NQ)),
        err_after=np.zeros((NS, NB, H, NQ)), kv_bytes=np.zeros((NS, NB, n_kv, NQ)),
        kv_pages=np.zeros((NS, NB, n_kv, NQ)), evicted=np.zeros((n_kv, NQ)),
        tier_nf=np.zeros((NS, NB, NQ, n_tiers)), tier_nb=np.zeros((NS, NB, NQ, n_tiers)),
        kept_tokens=np.zeros(NQ, dtype=np.int64),
        order=np.full((NS, NQ, pages.off[-1]) if want_order else (0, 0, 0), -1,
                      dtype=np.int64),
        nsel=np.zeros((NS, NB, NQ), dtype=np.int64))
    work = int(np.sum(att.qpos + 1)) * H * d
    # one step (the in-loop fetch) has nothing to run in parallel
    fn = _layer_serial if work < SERIAL_BELOW or NQ == 1 else _layer_parallel
    sinks = np.full(H, -np.inf) if att.sinks is None else att.sinks
    att = att._replace(qpos=np.ascontiguousarray(att.qpos, dtype=np.int64),
                       scale=float(att.scale), softcap=float(att.softcap or 0.0),
                       window=int(att.window or 0),
                       sinks=np.ascontiguousarray(sinks, dtype=np.float64))
    inc = inc._replace(hajek=bool(inc.hajek), certified=bool(inc.certified))
    pages = pages._replace(page=int(pages.page))
    schedule = schedule._replace(need_bound=bool(schedule.need_bound),
                           need_uniforms=bool(schedule.need_uniforms))
    with quiet_first_class_functions():
        fn(att, inc, pages, schedule, out, plugin_priority(()) if plugin is None else plugin)
    return out._asdict()
