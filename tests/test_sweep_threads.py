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


def test_in_process_limit_restores_the_callers_thread_counts():
    # An in-process calibration (``sweep --dry-run``) must not leave the calling process, a
    # notebook or this test session, single-threaded.
    import numba
    from threadpoolctl import threadpool_info

    from tracesim.sweep.worker import threads_limited

    before = (numba.get_num_threads(), [p["num_threads"] for p in threadpool_info()])
    with threads_limited(1) as t:
        assert t == 1 and numba.get_num_threads() == 1
        assert all(p["num_threads"] == 1 for p in threadpool_info())
    assert (numba.get_num_threads(), [p["num_threads"] for p in threadpool_info()]) == before
