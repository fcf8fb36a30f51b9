"""Tangram: fixed per-head budgets calibrated offline, over a chosen base score.

Source: Kim, Kim, Kim, Choi, "Tangram: Unlocking Non-Uniform KV Cache Compression for
Efficient Multi-turn LLM Serving", arXiv 2606.06302 (2026; abstract and introduction read).
Head-wise retention has an input-invariant head ranking with narrowly bounded per-head ratios,
calibrated offline (about 50 samples); each head's post-compression budget is then fixed before
the input is seen. Ada-KV, by contrast, re-allocates on every input.
:func:`tracesim.replay.calibrate.calibrate_tangram` derives the ratios from Ada-KV's
allocations on calibration sequences
(:func:`tracesim.budgets.tangram_ratios`); :class:`TangramScore` replays with them.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from tracesim.budgets import tangram_allocation
from tracesim.layer_trace import LayerTrace
from tracesim.policies.base import Score
from tracesim.policies.composed import base_score

__all__ = ["TangramScore", "load_tangram_profile", "save_tangram_profile"]

MAX_PROFILE_BYTES = 64 << 20


@lru_cache(maxsize=8)
def load_tangram_profile(path: str) -> np.ndarray:
    """The ``ratios`` array (n_layers, n_kv_heads) of a profile ``.npz``, validated; a
    ``ValueError`` names the file and the field."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"TangramScore.profile = {path!r}: no such file (expected the .npz "
                         f"written by tracesim.policies.tangram.save_tangram_profile)")
    if p.stat().st_size > MAX_PROFILE_BYTES:
        raise ValueError(f"{path}: {p.stat().st_size} bytes, expected at most "
                         f"{MAX_PROFILE_BYTES}")
    try:
        with np.load(p, allow_pickle=False) as npz:
            if "ratios" not in npz.files:
                raise ValueError(f"{path}: no field 'ratios'; expected a float (n_layers, "
                                 f"n_kv_heads) array named 'ratios'")
            ratios = npz["ratios"]
    except (OSError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: not a readable .npz without pickles ({exc})") from None
    if (ratios.ndim != 2 or ratios.dtype.kind != "f" or not np.isfinite(ratios).all()
            or (ratios < 0).any() or (ratios.sum(axis=1) <= 0).any()):
        raise ValueError(f"{path}: field 'ratios' (shape {ratios.shape}, dtype {ratios.dtype}): "
                         f"expected finite non-negative floats (n_layers, n_kv_heads), every "
                         f"layer with a positive sum")
    return ratios.astype(np.float64)


def save_tangram_profile(path: str | Path, ratios: np.ndarray) -> None:
    """Write per-(layer, KV head) ratios as a profile ``.npz`` (field ``ratios``)."""
    np.savez(Path(path), ratios=np.asarray(ratios, dtype=np.float64))


@dataclass(frozen=True)
class TangramScore(Score):
    """The base score's ranking with Tangram's fixed per-head budgets from a profile.

    Every head keeps ``sinks`` + ``window``; the layer's tail budget ``n_kv · T`` is split by
    the profile's ratios for this layer (:func:`~tracesim.budgets.tangram_allocation`), the
    same on every sequence; within a head the policy's design ranks or samples by ``base``.

    Parameters
    ----------
    base : str, default "h2o"
        Registry name of the score that ranks (or samples) each head's tail.
    profile : str, default ""
        A profile ``.npz`` (:func:`save_tangram_profile`, from
        :func:`tracesim.replay.calibrate.calibrate_tangram`);
        empty: equal ratios, i.e. uniform budgets (Tangram before calibration).
    """

    name: ClassVar[str] = "tangram"
    transform: ClassVar[str] = "the base score (>= 0 as is); fixed per-head budgets"

    window: int = 32
    base: str = "h2o"
    profile: str = ""

    def validate(self) -> None:
        base_score("TangramScore", self.base, int(self.sinks), int(self.window))
        if self.profile:
            load_tangram_profile(str(self.profile))

    def base_score(self) -> Score:
        return base_score("TangramScore", self.base, int(self.sinks), int(self.window))

    def compress_end(self, trace: LayerTrace) -> int:
        return self.base_score().compress_end(trace)

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        return self.base_score().scores(trace, kv_head, end)

    def check_budget(self, budget: Any) -> None:
        if budget.allocator != "uniform":
            raise ValueError(f"tangram sets each head's budget from its profile; the budget's "
                             f"allocator is {budget.allocator!r}, expected 'uniform'")

    def tail_budgets(self, trace: LayerTrace, tail_scores: list[np.ndarray], tail_budget: int,
                     budget: Any) -> np.ndarray:
        self.check_budget(budget)
        sizes = np.array([s.size for s in tail_scores], dtype=np.int64)
        if not self.profile:
            return tangram_allocation(np.ones(trace.n_kv_heads), tail_budget, sizes)
        ratios = load_tangram_profile(str(self.profile))
        if trace.layer >= ratios.shape[0] or ratios.shape[1] != trace.n_kv_heads:
            raise ValueError(f"{self.profile}: field 'ratios' has shape {ratios.shape}; layer "
                             f"{trace.layer} with {trace.n_kv_heads} KV heads needs "
                             f"(> {trace.layer}, {trace.n_kv_heads})")
        return tangram_allocation(ratios[trace.layer], tail_budget, sizes)
