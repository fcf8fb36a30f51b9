"""A learned-retention score read from a file: the Make-Each-Token-Count plugin example.

"Make Each Token Count" (Bui, Nguyen, Cohan, Ying; arXiv 2605.09649, code: TRIM-KV) trains
lightweight retention gates that give every cached KV entry a retention value ``beta_i`` in
(0, 1]; a token's utility decays geometrically with its age (the public TRIM-KV cache scores
``log(beta_i) * (q - i)`` with ``q`` the number of tokens seen plus one, a recent window
protected), and the lowest-utility entries are evicted, per head at a fixed budget. tracesim
trains nothing: this plugin *reads* the retention values a trained model produced, from a
file, and ranks tokens by them.

The file is an ``.npz`` (``numpy.savez``; read with ``allow_pickle=False``, nothing in it is
executed) with one array per sequence, named by the store's ``sequence_id``, of shape
``(n_layers, n_kv_heads, n_positions)``, float, every value in [0, 1]: the retention of each
position for each layer and KV head.

Use it in one process (notebook, Python API)::

    import tracesim
    from retention_score import RetentionScore
    tracesim.register_score(RetentionScore)
    policy = tracesim.policies.make_policy("retention", "poisson", 0.25,
                                           score_params={"path": "gates.npz"})

or, for ``tracesim replay`` and sweeps, package it with the entry point
``retention = "retention_score:RetentionScore"`` under ``tracesim.scores`` (docs/extending.md).
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import ClassVar

import numpy as np

from tracesim.policies import LayerTrace, Score

MAX_FILE_BYTES = 2 << 30  # a score file larger than this is refused, not read


@lru_cache(maxsize=4)
def load_retention(path: str) -> dict[str, np.ndarray]:
    """Every array of the score file, validated; ``ValueError`` naming the file and field."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"RetentionScore.path = {path!r}: no such file (expected an .npz "
                         f"of retention values, one array per sequence_id)")
    if p.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"{path}: {p.stat().st_size} bytes, expected at most {MAX_FILE_BYTES}")
    try:
        with np.load(p, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: not a readable .npz without pickles ({exc})") from None
    if not arrays:
        raise ValueError(f"{path}: no arrays; expected one per sequence_id")
    for name, a in arrays.items():
        if a.ndim != 3 or a.dtype.kind != "f":
            raise ValueError(f"{path}: field {name!r} has shape {a.shape} and dtype {a.dtype}; "
                             f"expected float (n_layers, n_kv_heads, n_positions)")
        if not np.isfinite(a).all() or (a < 0).any() or (a > 1).any():
            raise ValueError(f"{path}: field {name!r} has values outside [0, 1]; expected "
                             f"retention values in [0, 1]")
    return arrays


@dataclass(frozen=True)
class RetentionScore(Score):
    """``x_i = beta_i ** (end + 1 - i)`` (``geometric``) or ``beta_i``, from the score file.

    Reads nothing of the trace but its ``sequence_id``, ``layer`` and the event time ``end``.

    Parameters
    ----------
    path : str
        The ``.npz`` score file (module docstring).
    geometric : bool, default True
        Rank by the decayed utility ``beta_i^(end + 1 - i)`` (the paper's geometric retention,
        with the exponent of the TRIM-KV code's single-step score); False ranks by ``beta_i``.
    """

    name: ClassVar[str] = "retention"
    transform: ClassVar[str] = "beta ** age from a retention file (>= 0)"

    window: int = 0
    path: str = ""
    geometric: bool = True

    def validate(self) -> None:
        if not isinstance(self.geometric, bool):
            raise ValueError(f"RetentionScore.geometric = {self.geometric!r}: expected a bool")
        load_retention(str(self.path))  # a bad file fails when the policy is built

    def scores(self, trace: LayerTrace, kv_head: int, end: int,
               seed: int | None = None) -> np.ndarray:
        arrays = load_retention(str(self.path))
        a = arrays.get(str(trace.sequence_id))
        if a is None:
            raise ValueError(f"{self.path}: no field {trace.sequence_id!r}; expected one array "
                             f"per sequence_id of the store")
        want = (trace.layer + 1, trace.n_kv_heads, end)
        if a.shape[0] < want[0] or a.shape[1] != want[1] or a.shape[2] < end:
            raise ValueError(f"{self.path}: field {trace.sequence_id!r} has shape {a.shape}; "
                             f"expected (n_layers >= {want[0]}, {want[1]}, n_positions >= "
                             f"{end})")
        beta = a[trace.layer, kv_head, :end].astype(np.float64)
        if not self.geometric:
            return beta
        # The next query's position is end; TRIM-KV's public cache scores log(beta) * (q - i)
        # with q = tokens seen + 1 = end + 1, so the exponent is end + 1 - i (>= 2).
        age = np.arange(end + 1, 1, -1, dtype=np.float64)
        return np.power(beta, age)
