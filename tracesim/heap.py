"""Keep freed memory in the process for reuse (glibc ``malloc``), instead of faulting it back in.

A replay allocates and frees arrays of a few hundred KB to a few MB at every layer: the layer's
float64 tensors, the exp-logits, a score's attention rows, the compiled kernels' work arrays.
glibc serves such blocks with ``mmap`` or gives the top of its heap back to the kernel when
they are freed, so the next layer's arrays arrive as fresh pages: one minor page fault and a
page of zeros per 4 KiB. On the one configuration of ``docs/replay.md`` (30 layers of 1,024
positions, 32 seeds) that was 20,700-25,800 page faults per replay, and 460 with the
thresholds raised; the wall time fell to 0.91x (median of five alternated pairs of processes,
each the median of 7 replays, 2 cores).

:func:`keep_freed_memory` raises glibc's two thresholds once per process, as the
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` environment variables would: blocks
below :data:`MMAP_THRESHOLD_BYTES` come from the heap, and up to :data:`TRIM_THRESHOLD_BYTES`
of freed heap stay with the process. Larger arrays (a long context's exp-logits) are still
mapped and unmapped. The peak memory of a replay barely moves (a 32k-position replay: 491 ->
492 MB for SnapKV, 539 -> 559 MB for a per-step design); memory freed after the peak stays
with the process.

:class:`tracesim.replay.ReplaySetup` calls it; ``TRACESIM_KEEP_FREED_MEMORY=0`` switches it off
(for a process that embeds tracesim and must return memory at once). Other C libraries (musl,
macOS) have no ``mallopt`` and are left as they are.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "keep_freed_memory"]

#: Blocks at least this large are still mapped on their own (glibc's ceiling for the option).
MMAP_THRESHOLD_BYTES = 32 << 20
#: Freed memory at the top of the heap kept by the process before any is given back.
TRIM_THRESHOLD_BYTES = 256 << 20

# glibc's <malloc.h> option numbers
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_STATE: list[bool] = []


def keep_freed_memory() -> bool:
    """Set glibc's malloc thresholds (once per process); True when they are in force.

    False where the C library has no ``mallopt`` (not glibc), where ``mallopt`` refused a
    value, or where ``TRACESIM_KEEP_FREED_MEMORY=0``. Calling it again returns the first
    answer and changes nothing.
    """
    if _STATE:
        return _STATE[0]
    ok = False
    if os.environ.get("TRACESIM_KEEP_FREED_MEMORY", "1") != "0":
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (AttributeError, OSError):
            mallopt = None
        if mallopt is not None:
            mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            mallopt.restype = ctypes.c_int
            # mallopt returns 1 on success; the trim threshold first, so that a refused mmap
            # threshold leaves nothing half set that matters
            ok = (mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
                  and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1)
    _STATE.append(ok)
    return ok
