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

__all__ = ["group_softmax"]


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
