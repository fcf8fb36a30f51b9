"""Compiled per-step score of a plain layer: the group's proxy softmax rows and their reduction.

A per-step design (:class:`tracesim.policies.perstep.PerStepScore`) scores every decode step of
every KV head: the proxy logits of the group's query heads become softmax rows, reduced over the
heads by their mean or maximum. In numpy that was five passes and as many temporaries per step
(maximum, exponentials, sums, division, mean); here it is one kernel call that overwrites the
logits with the softmax rows and writes the reduction.

All arithmetic is float64, serial, in a fixed order: the result does not depend on the number
of threads. It agrees with the numpy formula to rounding (``tests/test_step_scores.py``).
"""

from __future__ import annotations

import numba as nb
import numpy as np

__all__ = ["group_softmax", "group_softmax_steps"]


@nb.njit(cache=True)
def group_softmax(s, reduce_max, x):
    """Softmax each row of ``s`` in place and reduce the rows into ``x``.

    s : float64 (n, m), the proxy logits of the group's ``n`` query heads over ``m`` positions;
        overwritten with their softmax rows (each row sums to 1)
    reduce_max : bool, ``x`` is the maximum over the rows (True) or their mean (False)
    x : float64 (m,), receives the reduction
    """
    n, m = s.shape
    for h in range(n):
        top = -np.inf
        for i in range(m):
            if s[h, i] > top:
                top = s[h, i]
        total = 0.0
        for i in range(m):
            w = np.exp(s[h, i] - top)
            s[h, i] = w
            total += w
        for i in range(m):
            s[h, i] /= total
    for i in range(m):
        acc = s[0, i]
        for h in range(1, n):
            if reduce_max:
                if s[h, i] > acc:
                    acc = s[h, i]
            else:
                acc += s[h, i]
        x[i] = acc if reduce_max else acc / n


@nb.njit(cache=True)
def _step_job(i, s, offsets, n, reduce_max, x, xoff):
    m = (offsets[i + 1] - offsets[i]) // n
    group_softmax(s[offsets[i]:offsets[i + 1]].reshape((n, m)), reduce_max,
                  x[xoff[i]:xoff[i + 1]])


@nb.njit(cache=True, parallel=True)
def _steps_par(s, offsets, n, reduce_max, x, xoff):
    for i in nb.prange(offsets.size - 1):
        _step_job(i, s, offsets, n, reduce_max, x, xoff)


@nb.njit(cache=True)
def _steps_ser(s, offsets, n, reduce_max, x, xoff):
    for i in range(offsets.size - 1):
        _step_job(i, s, offsets, n, reduce_max, x, xoff)


#: Logit entries below which :func:`group_softmax_steps` runs serially.
SERIAL_BELOW = 1 << 16


def group_softmax_steps(s: np.ndarray, offsets: np.ndarray, n: int, reduce_max: bool,
                        x: np.ndarray, xoff: np.ndarray) -> None:
    """:func:`group_softmax` of many steps, in parallel over the steps.

    s : float64 (total,), step ``i``'s logits ``(n, m_i)`` (row-major) at
        ``s[offsets[i]:offsets[i + 1]]``; overwritten with the softmax rows
    offsets : int64 (steps + 1,)
    n : int, query heads per step
    reduce_max : bool
    x : float64, step ``i``'s reduction (``m_i``) at ``x[xoff[i]:xoff[i + 1]]``
    xoff : int64 (steps + 1,)

    Every step is one serial :func:`group_softmax` call: the same values on any number of
    threads.
    """
    fn = _steps_ser if s.size < SERIAL_BELOW else _steps_par
    fn(s, offsets, int(n), bool(reduce_max), x, xoff)
