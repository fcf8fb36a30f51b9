"""A per-step design's rows computed together: the same values as the rule row by row.

Ground truth is the Python path the compiled one replaces: :func:`head_inclusion` with
:class:`PoissonPPS` for the probabilities, :meth:`PerStepScore.scores` one step at a time for
the scores, and numpy's own formula and ``sum`` for the key quantisation and the mixture's
normaliser. Each compiled piece repeats those operations in the same order, so the comparisons
are exact (float64 on this machine, both sides).
"""

from __future__ import annotations

import dataclasses

import numba
import numpy as np
import pytest

from tests.replay_fixtures import synthetic_trace
from tracesim.designs.poisson import PoissonPPS
from tracesim.kernels import step_inclusion as SI
from tracesim.kernels import step_scores as SS
from tracesim.policies import make_policy
from tracesim.proxies import quantise_keys
from tracesim.replay.engine import evaluated_queries
from tracesim.replay.head_rows import StepRows, head_inclusion
from tracesim.replay.inclusion import slot_events


def _rows(seed: int, n_rows: int):
    """Random rows in the shapes a per-step layer gives, with the cases the rule branches on:
    ties, zero scores, scores over 40 orders of magnitude, a sliding window, budgets below 0
    and above the tail, no top share and all of it, mixtures 0, 0.1 and 1, a floor."""
    rng = np.random.default_rng(seed)
    for i in range(n_rows):
        end = int(rng.integers(1, 700))
        x = rng.random(end) ** 3
        kind = i % 5
        if kind == 1:
            x = np.round(x * 4) / 4
        elif kind == 2:
            x[rng.random(end) < 0.7] = 0.0
        elif kind == 3:
            x = np.exp(rng.normal(0.0, 20.0, end))
        take = rng.random(end) < 0.1
        first_alive = int(rng.integers(0, end)) if i % 3 == 0 else 0
        budget = int(rng.integers(-2, end + 3))
        top_fraction = (0.0, 0.5, 0.25, 1.0)[i % 4]
        design = PoissonPPS(mixture=(0.0, 0.1, 1.0)[i % 3], floor=0.0 if i % 7 else 0.001)
        yield x, take, first_alive, budget, top_fraction, design


def _reference(x, take, first_alive, budget, top_fraction, design):
    alive = None if first_alive == 0 else np.arange(x.size) >= first_alive
    try:
        return head_inclusion(x, take, design, budget, top_fraction, alive)
    except ValueError:
        return None


def test_each_compiled_row_is_the_rule_bit_for_bit():
    checked = 0
    for x, take, first_alive, budget, top_fraction, design in _rows(0, 1500):
        ref = _reference(x, take, first_alive, budget, top_fraction, design)
        pi = np.full(x.size, np.nan)
        status = SI.poisson_row(x, take, first_alive, budget, top_fraction, design.mixture,
                                design.floor, pi)
        if ref is None:  # the rule refuses these scores: so must the kernel
            assert status == SI.ROW_REFUSED
            continue
        assert status == SI.ROW_OK
        np.testing.assert_array_equal(pi, ref)
        checked += 1
    assert checked > 1400


def test_rows_together_match_row_by_row_on_one_and_two_threads():
    rows = [r for r in _rows(1, 200) if r[5].mixture == 0.1 and r[5].floor == 0.0]
    scores = np.concatenate([r[0] for r in rows])
    offsets = np.concatenate([[0], np.cumsum([r[0].size for r in rows])]).astype(np.int64)
    take = np.concatenate([r[1] for r in rows])
    first_alive = np.array([r[2] for r in rows], dtype=np.int64)
    budgets = np.array([r[3] for r in rows], dtype=np.int64)
    before = numba.get_num_threads()
    outputs = []
    try:
        for threads, kernel in ((1, SI._rows_ser), (1, SI._rows_par), (2, SI._rows_par)):
            numba.set_num_threads(threads)
            pi = np.full(scores.size, np.nan)
            status = np.empty(len(rows), dtype=np.int64)
            kernel(scores, offsets, take, first_alive, budgets, 0.5, 0.1, 0.0, pi, status)
            outputs.append((pi, status))
    finally:
        numba.set_num_threads(before)
    for pi, status in outputs[1:]:
        assert pi.tobytes() == outputs[0][0].tobytes()
        assert status.tobytes() == outputs[0][1].tobytes()
    pi, status = outputs[0]
    for r, (x, take_r, fa, budget, _, design) in enumerate(rows):
        ref = _reference(x, take_r, fa, budget, 0.5, design)
        assert (status[r] == SI.ROW_OK) == (ref is not None)
        if ref is not None:
            np.testing.assert_array_equal(pi[offsets[r]:offsets[r + 1]], ref)


def test_a_refused_row_raises_the_rules_error():
    """A score the design rejects is not computed by the kernel: the rule runs and names it."""
    raw = np.ones((1, 1, 8))
    rows = StepRows(raw, PoissonPPS(mixture=0.1), 0.0)
    x = np.array([0.5, 0.2, -0.1, 0.4, 0.3, 0.1, 0.2, 0.3])
    rows.add(0, 0, x, np.zeros(8, dtype=bool), 0, 3)
    with pytest.raises(ValueError, match=r"scores\[2\] = -0.1: scores must be >= 0"):
        rows.flush()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 127, 128, 129, 255, 256, 257, 1000, 4096, 8191,
                               8192, 8193, 33333])
def test_the_pairwise_sum_is_numpys(n):
    rng = np.random.default_rng(n)
    x = rng.random(n) * 10.0 ** rng.uniform(-8, 8, n)
    assert SI._numpy_sum(x, 0, n) == x.sum()
    if n > 10:
        assert SI._numpy_sum(x, 3, n - 7) == x[3:n - 4].sum()


def _numpy_quantise(keys, bits, group):
    """The numpy formula of :func:`quantise_keys` (its previous implementation)."""
    K = np.asarray(keys, dtype=np.float64)
    levels = (1 << bits) - 1
    out = np.empty_like(K)
    for a in range(0, K.shape[0], group):
        block = K[a:a + group]
        lo = block.min(axis=0)
        step = (block.max(axis=0) - lo) / levels
        safe = np.where(step > 0, step, 1.0)
        out[a:a + group] = lo + np.rint((block - lo) / safe) * step
    return out


@pytest.mark.parametrize("P", [1, 31, 32, 33, 100, 1000])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_compiled_quantisation_is_the_numpy_formula(P, bits):
    rng = np.random.default_rng(P * 10 + bits)
    K = rng.standard_normal((P, 9)) * 3
    K[:, 4] = 1.5  # a constant channel is exact
    K[::7, 2] = 0.5  # halfway levels: rint's ties to even
    for group in (1, 7, 32, 5000):
        np.testing.assert_array_equal(quantise_keys(K, bits, group),
                                      _numpy_quantise(K, bits, group))
    bad = K.copy()
    bad[0, 1], bad[-1, 3] = np.nan, np.inf
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(quantise_keys(bad, bits, 32),
                                      _numpy_quantise(bad, bits, 32))


@pytest.mark.parametrize("proxy,gqa", [("quant:4", "mean"), ("exact", "max"),
                                       ("lowrank:8", "mean"), ("simhash:8,16", "mean"),
                                       ("pages:16", "max")])
@pytest.mark.parametrize("variant", [{}, {"window": 24}])
def test_step_scores_are_the_scores_of_each_step(proxy, gqa, variant):
    trace = dataclasses.replace(synthetic_trace(5, o_proj=False), **variant)
    score = make_policy("perstep", "poisson", 0.3, schedule="step",
                        score_params={"proxy": proxy, "gqa": gqa}).score
    qi = evaluated_queries(trace)
    ends = np.array(sorted({int(trace.query_positions[i]) for i in qi
                            if trace.query_roles[i] == "decode"}))
    assert ends.size > 3
    for g in range(trace.n_kv_heads):
        together = score.step_scores(trace, g, ends)
        for t, x in zip(ends, together, strict=True):
            np.testing.assert_array_equal(x, score.scores(trace, g, int(t)))


def test_group_softmax_steps_on_one_and_two_threads():
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 900, 40)
    offsets = np.concatenate([[0], np.cumsum(3 * sizes)]).astype(np.int64)
    xoff = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    logits = rng.normal(0.0, 4.0, offsets[-1])
    before = numba.get_num_threads()
    results = []
    try:
        for threads, kernel in ((1, SS._steps_ser), (2, SS._steps_par)):
            numba.set_num_threads(threads)
            s, x = logits.copy(), np.empty(xoff[-1])
            kernel(s, offsets, 3, False, x, xoff)
            results.append(x)
    finally:
        numba.set_num_threads(before)
    assert results[0].tobytes() == results[1].tobytes()
    for i in range(sizes.size):
        s = logits[offsets[i]:offsets[i + 1]].reshape(3, -1).copy()
        x = np.empty(s.shape[1])
        SS.group_softmax(s, False, x)
        np.testing.assert_array_equal(results[0][xoff[i]:xoff[i + 1]], x)


def test_slot_events_of_a_per_step_design_are_the_rule_row_by_row():
    """The tables of a per-step Poisson design (rows together) against the rule applied to the
    same scores, take-all masks and budgets one row at a time, on a plain and a sliding layer."""
    for variant in ({}, {"window": 24}):
        trace = dataclasses.replace(synthetic_trace(5, o_proj=False), **variant)
        policy = make_policy("perstep", "poisson", 0.3, schedule="step",
                             design_params={"mixture": 0.1},
                             score_params={"proxy": "quant:4", "window": 2})
        qpos = trace.query_positions[evaluated_queries(trace)].astype(np.int64)
        pi, tau, budgets = slot_events(trace, policy, None, 4, qpos)
        score = policy.score
        for e, t in enumerate(tau):
            t = int(t)
            window = None if trace.window is None else np.arange(t) > t - trace.window
            for g in range(trace.n_kv_heads):
                take = score.take_all(trace, g, t)
                if window is not None:
                    take = take & window
                tail_budget = int(budgets[e, g]) - int(take.sum())
                ref = head_inclusion(score.scores(trace, g, t), take, policy.design,
                                     tail_budget, score.top_fraction, window)
                np.testing.assert_array_equal(pi[e, g, :t], ref)
                assert (pi[e, g, t:] == 1.0).all()
