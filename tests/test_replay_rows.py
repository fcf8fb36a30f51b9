"""The per-row sums do not depend on where the heap placed their arrays.

Ground truth: the same call with every array far from the others (separate buffers); each
placement puts the output row right after an input row, as malloc often does with a unit's
small rows, within the reach of a vectorised loop's run-time overlap test.
"""

from __future__ import annotations

import numpy as np
import pytest

from tracesim.kernels.replay_rows import cross_sums, row_sums, tail_sums


def _bits(values) -> bytes:
    return np.array(values, dtype=np.float64).tobytes()


@pytest.mark.parametrize("n", [5, 7, 13, 31, 40, 77])
def test_sums_are_the_same_bits_wherever_the_rows_lie(n):
    rng = np.random.default_rng(n)
    w, wb, cw, vnk, vqd = (rng.random(n) for _ in range(5))
    far_row, far_xrow = np.empty(n), np.empty(n)
    far = tail_sums(w, cw, vnk, vqd, n, True, far_row), tail_sums(
        w, cw, vnk, vqd, n, False, np.empty(n))
    far_x = cross_sums(w, wb, cw, vqd, n, far_xrow)
    far_r = row_sums(w, cw, n)
    for gap in range(0, 48):
        # One buffer: the inputs first, the output row ``gap`` doubles after the last.
        buf = np.zeros(6 * n + gap)
        w_, wb_, cw_, vnk_, vqd_ = (buf[i * n:(i + 1) * n] for i in range(5))
        for dst, src in zip((w_, wb_, cw_, vnk_, vqd_), (w, wb, cw, vnk, vqd), strict=True):
            dst[:] = src
        out = buf[5 * n + gap:6 * n + gap]
        for use_os, ref in zip((True, False), far, strict=True):
            got = tail_sums(w_, cw_, vnk_, vqd_, n, use_os, out)
            assert _bits(got) == _bits(ref), (n, gap, use_os)
            assert out.tobytes() == far_row.tobytes()
        assert _bits(cross_sums(w_, wb_, cw_, vqd_, n, out)) == _bits(far_x), (n, gap)
        assert out.tobytes() == far_xrow.tobytes()
        assert _bits(row_sums(w_, cw_, n)) == _bits(far_r)
