"""Peers on sliding-window, soft-capped and sink layers: at full budget every peer's estimate is
the layer's truth; loop references of each peer's selection on a windowed layer; vAttention's
denominator statistics with a sink and capped logits, recomputed by a loop."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import special

from tests.replay_fixtures import synthetic_trace
from tracesim.attention_rule import attention_outputs
from tracesim.peers import MagicPIG, Quest, VAttention, replay_peers, step_inputs
from tracesim.peers.base import PURPOSE_VATT_BASE, PURPOSE_VATT_FINAL, peer_uniforms
from tracesim.proxies import hyperplanes
from tracesim.replay import load_layer
from tracesim.store import open_store
from tracesim.synth.store import SynthConfig, write_synthetic_store

SMALL = dict(positions=120, layers=2, decode=8, window=8, question=8, h2o_queries=16,
             dtype="float32", o_proj=False)
VARIANTS = {"sliding": dict(sliding_window=20, full_every=2),
            "softcap": dict(softcap=4.0),
            "sinks": dict(sinks=True),
            "all": dict(sliding_window=20, full_every=2, softcap=4.0, sinks=True)}
WINDOW = 48


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant_store(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "store"
    write_synthetic_store(path, SynthConfig(**SMALL, **VARIANTS[request.param]))
    return path


def test_truth_is_the_layer_rule(variant_store):
    """step_inputs' truth is attention_rule's windowed, capped, sinked output."""
    store = open_store(variant_store)
    trace = load_layer(store, next(iter(store)), 0)
    for qi in trace.role_indices("decode")[::3]:
        for h in (0, trace.n_heads - 1):
            x = step_inputs(trace, h, int(qi))
            g = h // trace.group_size
            want = attention_outputs(trace.queries[h:h + 1, [qi]], trace.keys[g:g + 1],
                                     trace.values[g:g + 1], trace.query_positions[[qi]],
                                     trace.scale, window=trace.window, softcap=trace.softcap,
                                     sinks=None if x.sink is None else np.array([x.sink]))
            np.testing.assert_allclose(x.truth, want[0, 0], rtol=1e-12, atol=1e-14)
            assert x.start == trace.window_start(x.step) and x.n == x.step + 1 - x.start


def test_every_peer_at_full_budget_is_the_truth(variant_store):
    store = open_store(variant_store)
    peers = [Quest(page=4, budget=1.0), VAttention(sinks=2, local=2, heavy=1.0),
             MagicPIG(bits=2, tables=4, sinks=0, local=1 << 20)]
    table = replay_peers(store, peers, [0, 1]).to_pandas()
    assert set(table["peer"]) == {"quest", "vattention", "magicpig"}
    assert (table["truth_norm"] > 0).all()
    assert table["rel_err"].max() <= 1e-12, table.groupby("peer")["rel_err"].max()
    # the sliding layer attends at most its window (the budget is a share of what it holds)
    kept = table.groupby("layer")["kept_tokens"].max()
    window = store.layer_attention(0).window
    if window is not None:
        assert kept[0] <= window < kept[1]


@pytest.fixture(scope="module")
def windowed():
    trace = synthetic_trace(5, n_heads=4, n_kv=2, d=8, P=160, prompt_length=140)
    trace.window = WINDOW
    trace.softcap = 3.0
    trace.sinks = np.array([0.5, -1.0, 2.0, 0.0])
    return trace


def _decode_inputs(trace):
    qidx = np.flatnonzero(np.array(trace.query_roles) == "decode")
    return [step_inputs(trace, h, int(qi)) for qi in qidx[::4] for h in (0, 3)]


def test_quest_selection_matches_a_loop_over_absolute_pages(windowed):
    page, budget = 8, 0.3
    peer = Quest(page=page, budget=budget)
    for x in _decode_inputs(windowed):
        lo, t = x.start, x.step
        assert lo == t - WINDOW + 1
        bounds = {}
        for j in range(lo // page, t // page + 1):
            a, b = max(lo, j * page), min(t, (j + 1) * page - 1)
            k = windowed.keys[x.kv_head, a:b + 1]
            bounds[j] = sum(max(x.query[c] * k[:, c].min(), x.query[c] * k[:, c].max())
                            for c in range(k.shape[1]))
        tokens = int(budget * x.n)
        n_pick = min(len(bounds), max(3, tokens // page))
        order = sorted(bounds, key=lambda j: (-bounds[j], j))[:n_pick]
        want = np.zeros(x.n, dtype=bool)
        for j in order:
            for p in range(max(lo, j * page), min(t, (j + 1) * page - 1) + 1):
                want[p - lo] = True
        _, out, kept = peer.attend(x, None, 0, 1.96)
        np.testing.assert_array_equal(kept, want)
        # plain softmax over the kept tokens, capped logits and the sink
        s = x.logits[kept]
        top = max(s.max(), x.sink)
        w = np.exp(s - top)
        np.testing.assert_allclose(out, w @ x.values[kept] / (w.sum() + np.exp(x.sink - top)),
                                   rtol=1e-10)


def test_magicpig_selection_matches_a_loop_on_a_window(windowed):
    peer = MagicPIG(bits=3, tables=12, sinks=4, local=16)
    P, seed = windowed.prompt_length, 3
    for x in _decode_inputs(windowed):
        g = x.kv_head
        keys = windowed.keys[g]
        range_lo, range_hi = max(0, P - WINDOW) + 4, P - 16   # hashed at prefill
        mu = keys[range_lo:range_hi].mean(axis=0)
        W = hyperplanes(windowed.layer, g, keys.shape[1], 36, seed=seed)
        qcode = ((x.query @ W) > 0).reshape(12, 3)
        state = peer.prepare(windowed.layer, g, keys, P, seed, WINDOW)
        _, _, kept = peer.attend(x, state, seed, 1.96)
        for p in range(x.start, x.step + 1):
            if p < x.start + 4 or p >= range_hi:
                want = True                                       # dense
            else:
                assert range_lo <= p
                code = (((keys[p] - mu) @ W) > 0).reshape(12, 3)
                want = int((code == qcode).all(axis=1).sum()) >= 2
            assert kept[p - x.start] == want, (x.step, p)


def test_vattention_rule_with_a_window_sink_and_cap(windowed):
    """Deterministic part, draws, budget, D_hat, D_b and the estimate by a loop: the sink is a
    take-all term of every denominator, never a key to draw."""
    peer = VAttention(sinks=3, local=5, heavy=0.1, base_rate=0.2, epsilon=0.3, delta=0.2)
    seed = 4
    for x in _decode_inputs(windowed):
        n = x.n
        s = [float(v) for v in x.logits]
        top = max(max(s), x.sink)
        e = [np.exp(v - top) for v in s]
        e_sink = np.exp(x.sink - top)
        det = set(range(3)) | set(range(n - 5, n))
        rest = [i for i in range(n) if i not in det]
        det |= set(sorted(rest, key=lambda i: (-s[i], i))[:int(0.1 * n)])
        start, R = 3, n - 5 - 3
        n_base = max(2, int(0.2 * R))
        ub = peer_uniforms(seed, x.layer, x.head, x.step, PURPOSE_VATT_BASE, n_base)
        base = [start + min(int(u * R), R - 1) for u in ub]
        d_hat = sum(e[i] for i in det) + R / n_base * sum(e[i] for i in set(base)) + e_sink
        sigma = max(float(np.std([e[i] for i in base], ddof=1)), 1e-8)
        zq = float(special.ndtri(1 - 0.2))
        raw = (zq * sigma * R / max(0.3 * d_hat, 1e-8)) ** 2
        b = min(max(int(np.floor(min(max(raw, 1.0), R))), n_base), R)
        uf = peer_uniforms(seed, x.layer, x.head, x.step, PURPOSE_VATT_FINAL, b)
        sampled = {start + min(int(u * R), R - 1) for u in uf} - det
        wts = {i: 1.0 for i in det} | {i: R / b for i in sampled}
        num = sum(wts[i] * e[i] * x.values[i] for i in wts)
        den = sum(wts[i] * e[i] for i in wts) + e_sink
        D = sum(e) + e_sink
        row, out, kept = peer.attend(x, None, seed, 1.96)
        assert row["budget_b"] == b
        assert set(np.flatnonzero(kept)) == det | sampled
        np.testing.assert_allclose(out, num / den, rtol=1e-10)
        assert row["peer_den_ok"] == float(abs(den - D) <= 0.3 * D)


def test_full_layers_are_unchanged_by_the_variant_code(windowed):
    """On a plain full layer the step input is what it always was: [0, t], raw logits."""
    plain = synthetic_trace(5, n_heads=4, n_kv=2, d=8, P=160, prompt_length=140)
    x = step_inputs(plain, 1, int(np.flatnonzero(np.array(plain.query_roles) == "decode")[-1]))
    assert x.start == 0 and x.sink is None and x.softcap is None and x.n == x.step + 1
    np.testing.assert_array_equal(x.logits, plain.keys[0, :x.n] @ x.query * plain.scale)
