"""``pages:P``: Quest's page upper bounds from per-page elementwise min/max keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from tracesim.proxies.base import Proxy

if TYPE_CHECKING:  # the policies import the proxies, not the other way round
    from tracesim.layer_trace import LayerTrace

__all__ = ["PageProxy", "page_upper_bounds"]


def page_upper_bounds(queries: np.ndarray, keys: np.ndarray, page: int) -> np.ndarray:
    """Quest's criticality ``sum_c max(q_c kmin_c, q_c kmax_c)`` of every page, per query.

    Pages are ``[j page, (j+1) page)`` from position 0 (the last may be shorter); ``kmin`` and
    ``kmax`` are the elementwise minimum and maximum of the page's keys. The bound is an upper
    bound of ``q . k`` for every key of the page. Returns ``(n, n_pages)``, unscaled.
    """
    P = keys.shape[0]
    starts = np.arange(0, P, page)
    kmin = np.minimum.reduceat(keys, starts, axis=0)
    kmax = np.maximum.reduceat(keys, starts, axis=0)
    q = np.asarray(queries, dtype=np.float64)[:, None, :]
    return np.maximum(q * kmin[None], q * kmax[None]).sum(axis=2)


@dataclass(frozen=True)
class PageProxy(Proxy):
    """Every token gets its page's Quest upper bound as its logit (times ``scale``).

    The pages cover the cached positions ``[0, end)`` at each step (the partial last page's
    min/max over what exists). Quest ranks pages by this bound; as a proxy it gives every
    token of a page the same inclusion probability. Memory: a min and a max key per page in
    fp16, ``2 * 16 * d / page`` bits per token.

    Parameters
    ----------
    page : int
        Positions per page (Quest's default 16).
    """

    name: ClassVar[str] = "pages"

    page: int = 16

    def validate(self) -> None:
        if isinstance(self.page, bool) or not isinstance(self.page, int) \
                or not 1 <= self.page <= 1 << 16:
            raise ValueError(f"pages proxy: page = {self.page!r}: expected an int in "
                             "[1, 65536] (positions per page)")

    def spec(self) -> str:
        return f"pages:{self.page}"

    def bits_per_token(self, head_dim: int) -> float:
        return 32.0 * head_dim / self.page

    def logits(self, trace: LayerTrace, kv_head: int, queries: np.ndarray,
               end: int) -> np.ndarray:
        bounds = page_upper_bounds(queries, trace.keys[kv_head, :end], self.page)
        return np.repeat(bounds, self.page, axis=1)[:, :end] * trace.scale
