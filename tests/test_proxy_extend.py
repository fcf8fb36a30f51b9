"""Per-step proxies in the loop: SimHash codes built once per layer, one appended per token.

Ground truth: the codes rebuilt from scratch on the layer as its cache stands at each step.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.replay_fixtures import synthetic_trace
from tracesim.layer_trace import LayerTrace
from tracesim.proxies import SimHashProxy
from tracesim.proxies.base import carry_summaries, proxy_summaries


def _at_step(trace: LayerTrace, end: int) -> LayerTrace:
    """The layer as the cache holds it at the decode step of position ``end`` (keys and
    values of ``[0, end]``, the queries up to ``end``): a new trace, as in the loop."""
    keep = trace.query_positions <= end
    return LayerTrace(layer=trace.layer, keys=trace.keys[:, :end + 1].copy(),
                      values=trace.values[:, :end + 1].copy(), queries=trace.queries[:, keep],
                      h2o=trace.h2o[:, :end + 1].copy(),
                      query_positions=trace.query_positions[keep],
                      query_roles=[r for r, k in zip(trace.query_roles, keep, strict=True) if k],
                      prompt_length=trace.prompt_length, question_start=trace.question_start,
                      scale=trace.scale)


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(11, n_heads=4, n_kv=2, d=8, P=96, prompt_length=80)


def test_carried_simhash_codes_equal_the_rebuilt_ones_and_are_not_rebuilt(trace, monkeypatch):
    proxy = SimHashProxy(bits=4, tables=32)
    q = trace.queries[:2, -1]
    builds = []
    codes = SimHashProxy._codes
    monkeypatch.setattr(SimHashProxy, "_codes",
                        lambda self, tr, g: builds.append(g) or codes(self, tr, g))
    carried: dict = {}
    carried_builds = []
    for end in range(trace.prompt_length, trace.n_positions):
        step = _at_step(trace, end)
        carry_summaries(carried, step)
        before = len(builds)
        got = {g: proxy.logits(step, g, q, end) for g in range(trace.n_kv_heads)}
        carried_builds += builds[before:]
        carried = proxy_summaries(step)
        fresh = _at_step(trace, end)
        for g in range(trace.n_kv_heads):
            mu, W, c, n = carried[("proxy", proxy.spec(), g)]
            mu0, W0, c0, n0 = codes(proxy, fresh, g)
            assert c.shape == (end + 1, 4 * 32 // 8) and c.dtype == np.uint8
            np.testing.assert_array_equal(c, c0)
            np.testing.assert_array_equal(n, n0)
            np.testing.assert_array_equal(mu, mu0)
            np.testing.assert_array_equal(W, W0)
            np.testing.assert_array_equal(got[g], proxy.logits(fresh, g, q, end))
    # Built once per KV head, at the first step; every later step appended one code.
    assert carried_builds == list(range(trace.n_kv_heads))


def test_codes_of_another_layer_are_rebuilt_not_extended(trace):
    proxy = SimHashProxy(bits=4, tables=32)
    other = synthetic_trace(12, n_heads=4, n_kv=2, d=8, P=96, prompt_length=80)
    q = trace.queries[:2, -1]
    end = trace.prompt_length + 3
    donor = _at_step(other, end - 1)
    proxy.logits(donor, 0, q, end - 1)
    step = _at_step(trace, end)
    carry_summaries(proxy_summaries(donor), step)
    got = proxy.logits(step, 0, q, end)
    np.testing.assert_array_equal(got, proxy.logits(_at_step(trace, end), 0, q, end))
