"""One sweep worker is one core: a single numba / BLAS thread unless asked otherwise."""

from __future__ import annotations

import pytest

from tracesim.sweep.run import _threads


@pytest.mark.parametrize("workers", [1, 2, 8])
def test_default_is_one_thread_per_worker(workers):
    assert _threads(workers, None) == 1


def test_explicit_threads_are_kept_and_checked():
    assert _threads(1, 2) == 2
    with pytest.raises(ValueError, match="threads_per_worker"):
        _threads(1, 0)
