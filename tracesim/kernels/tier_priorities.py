"""Fetch priorities of the tiers simulator: the per-page inputs and the built-in rules.

A fetch scheduler is a *priority rule*: a function of :class:`PageInputs`, what the simulator
knows about one evicted page at one decode step, returning a float; pages are fetched in
decreasing priority. Every rule is written twice, as a numba-compilable function of scalar
inputs (the kernel calls it once per page and step) and as a numpy function of the same inputs
as arrays over the layer's pages (the reference, :mod:`tracesim.tiers.reference`). The table
of schedulers that pairs them is :mod:`tracesim.tiers.schedulers`.

The built-in rules are compiled into the kernel through :func:`builtin_priority` (one branch
per scheduler code). Rules registered later reach the kernel as one first-class function
(:func:`plugin_priority`): a compiled C callback taking the rule's slot and the nine inputs,
so the kernel is compiled (and cached on disk) once whatever the registered rules are.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numba as nb
import numpy as np
from numba import types
from numba.core.dispatcher import Dispatcher
from numba.core.errors import NumbaExperimentalFeatureWarning

__all__ = ["N_BUILTIN", "PRIORITY_SIGNATURE", "PageInputs", "builtin_priority",
           "plugin_priority", "quiet_first_class_functions"]

#: Scheduler codes: the index of the name in :data:`tracesim.tiers.schedulers.SCHEDULERS`.
(S_NONE, S_RANDOM, S_CONFIDENCE, S_CERTIFICATE, S_CERTIFICATE_PAGE, S_BOUND, S_ORACLE,
 S_CERTIFICATE_BOUND) = range(8)
#: Codes at or above this are registered rules: ``code - N_BUILTIN`` is the rule's slot.
N_BUILTIN = 8


class PageInputs(NamedTuple):
    """What a priority rule may read about one evicted page ``p`` of KV head ``g`` at one step.

    In the kernel every field is a scalar; in the numpy reference the per-page and per-head
    fields are arrays of shape (NP,) over the layer's evicted pages (head by head, in position
    order; a head's value repeated on each of its pages) and the per-layer fields are floats.
    Pages a step cannot see yet are never fetched, whatever their priority.

    Attributes
    ----------
    uniform : float
        Permanent uniform of the page at this step (stream 2, keyed by seed, layer, KV head,
        step and page); 0 unless the scheduler declares ``needs_uniforms``.
    bound : float
        The page's term of the deterministic bound summed over the group's query heads,
        ``n_p exp(u_p) (|c_p - o_R| + r_p) / E_R`` (dimensionless); 0 unless some scheduler of
        the run declares ``needs_bound``, and 0 for pages the step cannot see.
    oracle_mass : float
        Softmax mass the page adds when fetched, summed over the group's query heads (reads the
        evicted keys: not deployable).
    page_cert : float
        The page's share of the certificate: ``(1 - pi_i) a_i^2 |v_i - o_hat|^2`` of its
        sampled tokens, summed over the group's query heads; 0 for an uncertified base policy.
    head_cert : float
        The KV head's certificate (sum over its query heads of ``tr V_hat``).
    head_bound : float
        Sum of ``bound`` over the KV head's pages.
    head_pages : int
        Evicted pages of the KV head.
    layer_cert : float
        Sum of ``page_cert`` over every page of the layer.
    layer_bound : float
        Sum of ``bound`` over every page of the layer.
    """

    uniform: Any
    bound: Any
    oracle_mass: Any
    page_cert: Any
    head_cert: Any
    head_bound: Any
    head_pages: Any
    layer_cert: Any
    layer_bound: Any


#: C signature of the registered rules' callback: ``(slot, *PageInputs) -> priority``.
PRIORITY_SIGNATURE = types.float64(types.int64, types.float64, types.float64, types.float64,
                                   types.float64, types.float64, types.float64, types.int64,
                                   types.float64, types.float64)


# -- the built-in rules, compiled (``*_priority``) and in numpy (``*_reference``) -------------

@nb.njit(cache=True)
def uniform_priority(x):
    """``random`` and ``confidence``: the permanent uniform."""
    return x.uniform


def uniform_reference(x: PageInputs) -> np.ndarray:
    return x.uniform


@nb.njit(cache=True)
def bound_priority(x):
    """``bound``: the page's bound term."""
    return x.bound


def bound_reference(x: PageInputs) -> np.ndarray:
    return x.bound


@nb.njit(cache=True)
def oracle_priority(x):
    """``oracle``: the softmax mass the page adds."""
    return x.oracle_mass


def oracle_reference(x: PageInputs) -> np.ndarray:
    return x.oracle_mass


@nb.njit(cache=True)
def certificate_priority(x):
    """``certificate``: the head's certificate times the page's share of the head's bound
    (an equal share when the head's bound is 0)."""
    frac = x.bound / x.head_bound if x.head_bound > 0 else 1.0 / max(1, x.head_pages)
    return x.head_cert * frac


def certificate_reference(x: PageInputs) -> np.ndarray:
    fallback = 1.0 / np.maximum(1, x.head_pages)
    frac = np.divide(x.bound, x.head_bound, out=fallback, where=x.head_bound > 0)
    return x.head_cert * frac


@nb.njit(cache=True)
def certificate_page_priority(x):
    """``certificate_page``: the page's certificate terms; pages without a sampled token
    follow in the ``certificate`` order (a 1e-9 tie-break)."""
    frac = x.bound / x.head_bound if x.head_bound > 0 else 0.0
    return x.page_cert + 1e-9 * x.head_cert * frac


def certificate_page_reference(x: PageInputs) -> np.ndarray:
    frac = np.divide(x.bound, x.head_bound, out=np.zeros(np.shape(x.bound)),
                     where=x.head_bound > 0)
    return x.page_cert + 1e-9 * x.head_cert * frac


@nb.njit(cache=True)
def certificate_bound_priority(x):
    """``certificate_bound``: the page's share of the layer's certificate plus its share of
    the layer's bound."""
    return (x.page_cert / x.layer_cert if x.layer_cert > 0 else 0.0) + (
        x.bound / x.layer_bound if x.layer_bound > 0 else 0.0)


def certificate_bound_reference(x: PageInputs) -> np.ndarray:
    return (x.page_cert / x.layer_cert if x.layer_cert > 0 else 0.0 * x.page_cert) + (
        x.bound / x.layer_bound if x.layer_bound > 0 else 0.0 * x.bound)


@nb.njit(cache=True)
def builtin_priority(code, x):
    """Priority of a page under built-in scheduler ``code`` (0 for ``none``, which fetches
    nothing)."""
    if code == S_RANDOM or code == S_CONFIDENCE:
        return uniform_priority(x)
    if code == S_BOUND:
        return bound_priority(x)
    if code == S_ORACLE:
        return oracle_priority(x)
    if code == S_CERTIFICATE:
        return certificate_priority(x)
    if code == S_CERTIFICATE_PAGE:
        return certificate_page_priority(x)
    if code == S_CERTIFICATE_BOUND:
        return certificate_bound_priority(x)
    return 0.0


# -- registered rules: one callback for the kernel -------------------------------------------

def _no_rule(slot, uniform, bound, oracle_mass, page_cert, head_cert, head_bound, head_pages,
             layer_cert, layer_bound):
    """The callback of a run without registered rules (never called)."""
    return 0.0


def _with_rule(previous: Any, rule: Any, slot: int) -> Any:
    """A compiled callback that calls ``rule`` for ``slot`` and ``previous`` otherwise."""
    def dispatch(which, uniform, bound, oracle_mass, page_cert, head_cert, head_bound,
                 head_pages, layer_cert, layer_bound):
        if which == slot:
            return rule(PageInputs(uniform, bound, oracle_mass, page_cert, head_cert,
                                   head_bound, head_pages, layer_cert, layer_bound))
        return previous(which, uniform, bound, oracle_mass, page_cert, head_cert, head_bound,
                        head_pages, layer_cert, layer_bound)
    return nb.njit(dispatch)


@functools.lru_cache(maxsize=64)
def plugin_priority(rules: tuple[Callable[..., float], ...]) -> Any:
    """The kernel's callback for the registered rules of one run: slot ``i`` is ``rules[i]``.

    Parameters
    ----------
    rules : tuple of callables
        Numba-compilable functions of one :class:`PageInputs` of scalars returning a float
        (``@numba.njit`` functions or plain functions numba can compile).

    Returns
    -------
    numba.cfunc
        A C callback of :data:`PRIORITY_SIGNATURE`; without rules, a placeholder (cached on
        disk) that the kernel never calls.
    """
    if not rules:
        return nb.cfunc(PRIORITY_SIGNATURE, cache=True)(_no_rule)
    chain = nb.njit(_no_rule)
    for slot, rule in enumerate(rules):
        compiled = rule if isinstance(rule, Dispatcher) else nb.njit(rule)
        chain = _with_rule(chain, compiled, slot)
    return nb.cfunc(PRIORITY_SIGNATURE)(chain.py_func)


@contextlib.contextmanager
def quiet_first_class_functions() -> Iterator[None]:
    """Hide numba's notice that first-class functions (the kernel's callback argument) are
    experimental: the kernel uses them in the one documented way, a C callback argument."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=NumbaExperimentalFeatureWarning)
        yield
