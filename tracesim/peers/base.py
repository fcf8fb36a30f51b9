"""What every peer replay shares: one decode step of one query head, the truth, the row.

A *peer* is a published sparse-attention method replayed as its reference code defines it
(``docs/peers.md``), not through tracesim's score x design x correction algebra: MagicPIG's
kept set comes from hash collisions, vAttention's from uniform draws with replacement whose
number its (epsilon, delta) rule sets per head, Quest's from page bounds. Each peer works on
one (layer, query head, decode step) at a time, in float64 numpy, and reports its own estimate
and, where its samples have known inclusion probabilities, tracesim's Poisson certificate of
the Hájek estimate on the same kept tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from tracesim.estimators import hajek_attention
from tracesim.prn import permanent_uniforms, step_stream

__all__ = ["Peer", "StepInput", "effective_size", "hajek_step_metrics", "hub_size",
           "peer_uniforms", "size_label"]

#: Purposes of the per-step uniforms of peers (the high half of the ``kv_head`` key field).
PURPOSE_VATT_BASE, PURPOSE_VATT_FINAL = 1, 2


def peer_uniforms(seed: int, layer: int, head: int, step: int, purpose: int,
                  n: int) -> np.ndarray:
    """``n`` permanent uniforms of a peer's own draws at one decode step of one query head.

    Key: stream ``2**31 + step`` (as fresh per-step designs), ``kv_head`` field
    ``purpose * 2**16 + head`` (query heads < 2**16), ``position`` = draw index.
    """
    if not 0 <= head < 1 << 16:
        raise ValueError(f"query head {head} outside [0, 65536)")
    return permanent_uniforms(int(seed), int(layer), (int(purpose) << 16) + int(head),
                              np.arange(int(n)), stream=step_stream(step))


def hub_size(value: object, where: str, lo: int) -> float | int:
    """A size parameter as ``xAlg-ai/sparse-attention-hub`` reads one: a float is a fraction of
    the ``N`` keys (here in [0, 1]; the hub would read 2.0 as ``2 N``), an int a count >= ``lo``.
    Refused otherwise with ``ValueError`` naming ``where``."""
    if isinstance(value, float):
        if not (np.isfinite(value) and 0.0 <= value <= 1.0 and (value > 0 or lo == 0)):
            raise ValueError(f"{where} = {value!r}: a float is a fraction of the cache, expected "
                             f"one in {'[0' if lo == 0 else '(0'}, 1]; write a token count as "
                             "an integer")
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= 1 << 31:
        raise ValueError(f"{where} = {value!r}: expected a number: a fraction of the cache "
                         f"(a float in (0, 1]) or a token count (an integer >= {lo})")
    return value


def effective_size(size: float | int, n: int) -> int:
    """The hub's ``_calculate_effective_size``: ``int(size N)`` for a float, ``size`` for an
    int (truncation, not rounding: 0.5 of 127 keys is 63)."""
    return int(size * n) if isinstance(size, float) else int(size)


def size_label(size: float | int) -> str:
    """``0.25``, ``1.0`` (every key) or ``256`` (tokens): a float keeps its point."""
    if isinstance(size, int):
        return str(size)
    text = f"{size:g}"
    return text if any(c in text for c in ".e") else text + ".0"


@dataclass
class StepInput:
    """One decode step of one query head: everything a peer may read.

    Attributes
    ----------
    layer, head, kv_head, step : int
        ``step`` is the query's position ``t``; the layer holds ``[start, t]`` (the current
        token included, as every reference appends it before attending): ``start = 0`` on a
        full layer, ``max(0, t - w + 1)`` on a sliding layer of window ``w``.
    prompt_length : int
    query : ndarray, shape (d,)
    keys, values : ndarray, shape (n, d)
        The ``n = t + 1 - start`` positions the layer holds; index ``i`` is position
        ``start + i``.
    scale : float
    logits : ndarray, shape (n,)
        Exact logits ``q . k * scale``, soft-capped when the layer is (float64).
    truth : ndarray, shape (d,)
        The full-cache output of the layer's rule (window, soft-cap, sink).
    start : int
        Position of ``keys[0]`` (0 on a full layer).
    softcap : float or None
        The layer's logit soft-cap ``c`` (``logits`` are already capped; estimators recompute
        logits with it).
    sink : float or None
        The head's learned sink logit: a take-all denominator term with zero value.
    """

    layer: int
    head: int
    kv_head: int
    step: int
    prompt_length: int
    query: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    scale: float
    logits: np.ndarray
    truth: np.ndarray
    start: int = 0
    softcap: float | None = None
    sink: float | None = None

    @property
    def n(self) -> int:
        """Positions the layer holds at this step (the peers' ``N``)."""
        return int(self.logits.size)

    def sink_weight(self, top: float) -> float:
        """``exp(sink - top)``, the sink's denominator term relative to ``top`` (0: none)."""
        return 0.0 if self.sink is None else float(np.exp(self.sink - top))


def hajek_step_metrics(x: StepInput, pi: np.ndarray, kept: np.ndarray, z: float,
              logit_offset: np.ndarray | None = None, correction: bool = True) -> dict:
    """Error, Poisson certificate and Wald coverage of the (offset) Hájek estimate on ``kept``.

    ``pi`` are the inclusion probabilities the estimate divides by (1 for the dense part).
    With ``correction=False`` and a ``logit_offset`` this is any softmax-with-offset estimator
    (vAttention's); its variance is then not a certificate and is not reported.
    """
    est = hajek_attention(x.query, x.keys, x.values, pi, kept, scale=x.scale,
                          correction=correction, variance="diag", logit_offset=logit_offset,
                          softcap=x.softcap, sink=x.sink)
    err = est.estimate - x.truth
    out = {"err2": float(err @ err), "estimate": est.estimate,
           "tail_size": int(est.tail_size), "n_eff": float(est.n_eff)}
    if correction:
        sd = np.sqrt(np.maximum(est.variance_diag, 0.0))
        out["cert2"] = float(est.variance_trace)
        out["wald_cov"] = (float(np.mean(np.abs(err) <= z * sd)) if est.tail_population
                           else float("nan"))
    else:
        out["cert2"] = out["wald_cov"] = float("nan")
    return out


class Peer:
    """Base class of peers: ``name``, ``randomized``, :meth:`label` and :meth:`step`."""

    name: ClassVar[str] = "peer"
    randomized: ClassVar[bool] = True

    def _check_ints(self, lo: int, *fields: str) -> None:
        """Refuse a field that is not an int in ``[lo, PEER_INT.hi]``, naming the peer and the
        field: every integer parameter of a peer (a page, a window, a table count) is at most
        2**20, so none can overflow the int32/int64 arithmetic of the kernels."""
        from tracesim.counts import PEER_INT

        for f in fields:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= PEER_INT.hi:
                shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
                raise ValueError(f"{self.name}: {f} = {shown}: expected an int in "
                                 f"[{lo}, {PEER_INT.hi}]")

    def label(self) -> str:
        raise NotImplementedError

    def prepare(self, layer: int, kv_head: int, keys: np.ndarray, prompt_length: int,
                seed: int, window: int | None = None) -> object:
        """Per (layer, KV head, seed) state built once for every step (default: none);
        ``keys`` are every stored position's, ``window`` the layer's sliding window."""
        return None

    def step(self, x: StepInput, state: object, seed: int, z: float) -> dict:
        """The peer's estimate at one step: a dict of result columns (see ``PEER_COLUMNS``)."""
        return self.attend(x, state, seed, z)[0]

    def attend(self, x: StepInput, state: object, seed: int, z: float
               ) -> tuple[dict, np.ndarray, np.ndarray]:
        """:meth:`step`'s row, the peer's own attention output (shape (d,)) and the tokens it
        attends (bool, shape (n,): the positions the layer holds, ``[start, t]``): what the
        in-loop run enforces
        (``tracesim.capture.inloop.peers``)."""
        raise NotImplementedError
