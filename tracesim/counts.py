"""One validated bound per count, shared by every spec and command line that spells it.

A count (seeds, layers, sequences, positions, page sizes, grid configurations, ...) can be
written as an int, a list, a range or a comma-separated option. Each spelling is checked
against the same :class:`Count` *before* anything is expanded or allocated, so a hostile
``seeds: [0, 1, ..., 99999]``, ``--layers 0,1,...,29999`` or ``--positions 1000000000000``
fails in microseconds with the field named, instead of allocating first. The limits are
documented in ``docs/sweeps.md`` ("Limits") and ``docs/threat-model.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tracesim.errors import UsageError

__all__ = ["BOOTSTRAP_REPLICATES", "DECODE_EVERY", "GRID_CONFIGS", "GRID_PARTS", "LAYER_INDEX",
           "LAYERS", "PAGE", "PEER_INT", "SEEDS", "SEED_VALUE", "SEQUENCES", "SUMMARY_PAGE",
           "SYNTH_LAYERS", "SYNTH_POSITIONS", "SYNTH_SEQUENCES", "TIERS_SEEDS", "Count",
           "check_finite", "parse_int", "parse_layers"]

ErrorType = type[Exception]


@dataclass(frozen=True)
class Count:
    """A bound ``[lo, hi]`` on one count, checked the same way wherever it is written.

    Parameters
    ----------
    what : str
        What is counted, in messages ("seeds", "layers", ...).
    hi : int
        Largest value (for an int) or length (for a list).
    lo : int, default 1
        Smallest value of an int count.
    """

    what: str
    hi: int
    lo: int = 1

    def check(self, value: Any, where: str, error: ErrorType = UsageError) -> int:
        """``value`` as an int in ``[lo, hi]``; ``error`` naming ``where`` otherwise."""
        if isinstance(value, bool) or not isinstance(value, int) or not \
                self.lo <= value <= self.hi:
            raise error(f"{where}: {_show(value)} is not a number of {self.what}, expected an "
                        f"int in [{self.lo}, {self.hi}]")
        return value

    def check_items(self, items: Sequence[Any], where: str, error: ErrorType = UsageError,
                    distinct: bool = True) -> None:
        """A list spelling: at most ``hi`` items (checked before any item is looked at) and,
        if ``distinct``, none repeated (the repeated value is named)."""
        if len(items) > self.hi:
            raise error(f"{where}: lists {len(items)} {self.what}, expected at most {self.hi}")
        if distinct:
            seen: dict[Any, int] = {}
            for i, v in enumerate(items):
                try:
                    first = seen.setdefault(v, i)
                except TypeError:  # unhashable: the caller's type check names it
                    continue
                if first != i:
                    raise error(f"{where}: {_show(v)} repeats (at [{first}] and [{i}]), "
                                f"expected distinct {self.what}")


def _show(value: Any) -> str:
    """A short repr: a hostile value may be huge."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_int(text: str, where: str, count: Count, error: ErrorType = UsageError) -> int:
    """An int option value (``"16"``; also ``"1e3"`` when it is an exact integer) in the
    bound of ``count``; the digits are checked before any conversion can overflow."""
    s = text.strip()
    try:
        if s.lstrip("+-").isdigit():
            if len(s) > 30:  # far beyond every bound: refuse without converting
                raise error(f"{where}: {_show(text)} is out of range, expected an int in "
                            f"[{count.lo}, {count.hi}]")
            value: Any = int(s)
        else:
            f = float(s)
            value = int(f) if math.isfinite(f) and f.is_integer() and abs(f) < 2**63 else f
    except ValueError:
        raise error(f"{where}: {_show(text)} is not an int, expected an int in "
                    f"[{count.lo}, {count.hi}]") from None
    return count.check(value, where, error)


def check_finite(value: Any, where: str, lo: float | None = None, hi: float | None = None,
                 error: ErrorType = UsageError, open_lo: bool = False) -> float:
    """A finite number (not NaN or inf) in ``[lo, hi]`` (``(lo, hi]`` if ``open_lo``)."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value)
          and (lo is None or (value > lo if open_lo else value >= lo))
          and (hi is None or value <= hi))
    if not ok:
        left = "-inf" if lo is None else f"{lo:g}"
        right = "inf" if hi is None else f"{hi:g}"
        bra = "(" if open_lo or lo is None else "["
        ket = "]" if hi is not None else ")"
        raise error(f"{where}: {_show(value)} is not a finite number in {bra}{left}, "
                    f"{right}{ket}, expected one")
    return float(value)


#: Seeds of a sweep, a replay or an in-loop run (an int n, or a list of distinct ints).
SEEDS = Count("seeds", 100_000)
#: Seeds of a tiers simulation (each seed is one fetch simulation of every policy).
TIERS_SEEDS = Count("seeds", 4096)
#: Largest seed value (permanent random numbers hash a uint32 seed).
SEED_VALUE = Count("seed value", 2**32 - 1, lo=0)
#: Layers selected by a list (model.json allows at most 4096 layers).
LAYERS = Count("layers", 4096)
#: Largest layer index.
LAYER_INDEX = Count("layer index", 4095, lo=0)
#: Sequence ids selected by a list.
SEQUENCES = Count("sequences", 1_000_000)
#: Page size (positions) of the deterministic-bound summaries; 0 = none.
SUMMARY_PAGE = Count("positions per summary page", 1 << 20, lo=0)
#: Positions per page of a memory-tier model or a page-based peer (Quest), and every other
#: integer parameter of a peer (windows, tables): far beyond any context, within int32.
PAGE = Count("positions per page", 1 << 20)
PEER_INT = Count("peer parameter", 1 << 20, lo=0)
#: Poisson-bootstrap replicates per row (0 = off; 1 is refused where it is checked: a variance
#: needs two replicates).
BOOTSTRAP_REPLICATES = Count("bootstrap replicates", 100_000, lo=0)
#: K of the ``decode:K`` schedule (decode steps between eviction events).
DECODE_EVERY = Count("decode steps between events", 1 << 20)
#: Configurations of a whole grid, summed over the mappings of a grid list.
GRID_CONFIGS = Count("configurations", 10_000)
#: Mappings in a grid list.
GRID_PARTS = Count("grid mappings", 1_000)
#: ``tracesim synth``: sequences, positions per sequence and layers of a synthetic store.
SYNTH_SEQUENCES = Count("sequences", 10_000)
SYNTH_POSITIONS = Count("positions", 1 << 20)
SYNTH_LAYERS = Count("layers", 4096)


def parse_layers(text: str, n_layers: int, option: str = "--layers",
                 error: ErrorType = UsageError) -> list[int]:
    """``START:STOP:STEP`` (parts optional) or ``0,4,8`` as layer indices of a store with
    ``n_layers`` layers.

    Every number is checked against :data:`LAYER_INDEX` before a range is built, and a layer the
    store does not have is refused (``0:100000000`` is not cut silently to the store's layers).
    """
    s = text.strip()
    if ":" in s:
        parts = s.split(":")
        if len(parts) > 3:
            raise error(f"{option} {_show(text)}: expected START:STOP:STEP or a comma-separated "
                        "list of layer indices")
        start, stop, step = (parts + ["", ""])[:3]
        lo = parse_int(start, option, LAYER_INDEX, error) if start.strip() else 0
        hi = (parse_int(stop, option, Count("layer stop", LAYER_INDEX.hi + 1, lo=0), error)
              if stop.strip() else n_layers)
        by = parse_int(step, option, Count("layer step", LAYER_INDEX.hi + 1), error) \
            if step.strip() else 1
        if hi > n_layers:
            raise error(f"{option} {_show(text)}: stop {hi} is beyond the store's {n_layers} "
                        f"layers, expected at most {n_layers}")
        out = list(range(lo, hi, by))
    else:
        items = s.split(",")
        LAYERS.check_items(items, option, error, distinct=False)  # counted before parsing
        out = [parse_int(v, option, LAYER_INDEX, error) for v in items]
        LAYERS.check_items(out, option, error)
    if not out:
        raise error(f"{option} {_show(text)}: selects no layer, expected at least one of "
                    f"[0, {n_layers})")
    beyond = [v for v in out if v >= n_layers]
    if beyond:
        raise error(f"{option}: layer {beyond[0]} is beyond the store's {n_layers} layers, "
                    f"expected indices in [0, {n_layers})")
    return out
