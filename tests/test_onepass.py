"""One-pass decode attention + certificates equal the two-pass code and tracesim's estimator."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tracesim.capture.inloop.enforce import serving_certificates  # noqa: E402
from tracesim.capture.inloop.onepass import onepass_attention, pair_quadratic_forms  # noqa: E402

from tracesim import hajek_attention, output_space_certificate  # noqa: E402

pytestmark = pytest.mark.capture


def _case(seed: int, *, H=6, n_kv=2, T=300, d=16, P=260, hidden=24, dtype=torch.float64):
    """A decode query over a cache of T positions whose first P (the prompt) are planned."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((H, d)) * 1.5
    k = rng.standard_normal((n_kv, T, d))
    v = rng.standard_normal((n_kv, T, d))
    pi = np.ones((n_kv, T))
    pi[:, 8:P - 16] = rng.uniform(0.05, 0.9, (n_kv, P - 24))
    kept = rng.random((n_kv, T)) < pi
    bias = np.where(kept, -np.log(pi), -np.inf)
    weight = np.where(kept & (pi < 1), 1 - pi, 0.0)
    W = rng.standard_normal((hidden, H * d)) / np.sqrt(H * d)
    G = H // n_kv
    cols = G * d
    gram = np.stack([W[:, g * cols:(g + 1) * cols].T @ W[:, g * cols:(g + 1) * cols]
                     for g in range(n_kv)])
    t = lambda a: torch.tensor(a, dtype=dtype)  # noqa: E731
    return dict(q=q, k=k, v=v, pi=pi, kept=kept, W=W, tq=t(q), tk=t(k), tv=t(v),
                bias=t(bias), weight=t(weight), gram=t(gram))


def _tail(c):
    """The two-pass code's padded tail index / weight."""
    n_kv = c["k"].shape[0]
    tail = c["kept"] & (c["pi"] < 1)
    m = int(tail.sum(1).max())
    idx = torch.zeros(n_kv, m, dtype=torch.long)
    w = torch.zeros(n_kv, m, dtype=c["tq"].dtype)
    for g in range(n_kv):
        pos = np.flatnonzero(tail[g])
        idx[g, :pos.size] = torch.from_numpy(pos)
        w[g, :pos.size] = torch.from_numpy(1 - c["pi"][g, pos])
    return idx, w


@pytest.mark.parametrize("block", [7, 64, 10_000])
@pytest.mark.parametrize("fixed", [False, True])
def test_onepass_equals_two_pass_and_the_estimator(block, fixed):
    c = _case(1)
    scale = 16**-0.5
    quad = pair_quadratic_forms(c["tv"], c["gram"], c["weight"])
    out, cert, layer = onepass_attention(c["tq"], c["tk"], c["tv"], c["bias"], c["weight"], scale,
                                         gram=c["gram"], quad=quad, fixed_size=fixed, block=block)
    idx, w = _tail(c)
    out2, cert2, layer2 = serving_certificates(c["tq"].float(), c["tk"].float(), c["tv"].float(),
                                               c["bias"].float(), idx, w.float(), scale,
                                               c["gram"].float(), fixed)
    # float32 arithmetic inside; the two-pass code in float32 too.
    np.testing.assert_allclose(out.numpy(), out2.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cert.numpy(), cert2.numpy(), rtol=1e-4, atol=1e-7)
    assert float(layer) == pytest.approx(float(layer2), rel=1e-4)
    H, G = 6, 3
    for h in range(H):
        g = h // G
        est = hajek_attention(c["q"][h], c["k"][g], c["v"][g], c["pi"][g], c["kept"][g],
                              scale=scale, variance="trace",
                              design_variance="fixed" if fixed else "poisson")
        np.testing.assert_allclose(out[h].numpy(), est.estimate, rtol=1e-5, atol=1e-6)
        assert float(cert[h]) == pytest.approx(float(est.variance_trace), rel=1e-4, abs=1e-8)
    ref = output_space_certificate(c["q"][:, None, :], c["k"], c["v"], c["pi"], c["kept"], c["W"],
                                   scale=scale)
    assert float(layer) == pytest.approx(float(ref.variance_trace[0]), rel=1e-4)


def test_without_weights_it_is_plain_attention_and_value_norms_may_be_cached():
    c = _case(2, H=4, n_kv=4, T=129, d=8, P=100)
    scale = 0.3
    out, cert, layer = onepass_attention(c["tq"], c["tk"], c["tv"], c["bias"], None, scale,
                                         block=32)
    assert cert is None and layer is None
    logits = torch.einsum("hd,htd->ht", c["tq"], c["tk"]) * scale + c["bias"]
    ref = torch.einsum("ht,htd->hd", torch.softmax(logits, -1), c["tv"])
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)
    vsq = (c["tv"] ** 2).sum(-1)
    _, a, _ = onepass_attention(c["tq"], c["tk"], c["tv"], c["bias"], c["weight"], scale, block=32)
    _, b, _ = onepass_attention(c["tq"], c["tk"], c["tv"], c["bias"], c["weight"], scale,
                                value_sq=vsq, block=32)
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)


def test_float32_inputs_stay_accurate_at_long_context():
    """8k keys in float32 over two blocks: certificates within 1e-3 relative of float64."""
    c = _case(3, H=4, n_kv=1, T=8192, d=32, P=8000, dtype=torch.float32)
    out, cert, _ = onepass_attention(c["tq"], c["tk"], c["tv"], c["bias"], c["weight"], 0.2,
                                     block=4096)
    for h in range(4):
        est = hajek_attention(c["q"][h], c["k"][0], c["v"][0], c["pi"][0], c["kept"][0],
                              scale=0.2, variance="trace")
        np.testing.assert_allclose(out[h].numpy(), est.estimate, atol=1e-5)
        assert float(cert[h]) == pytest.approx(float(est.variance_trace), rel=1e-3)


@pytest.mark.parametrize("fixed", [False, True])
def test_fully_masked_blocks_and_far_logits_match_the_estimator(fixed):
    """Blocks where one KV head has every key evicted, and logits ~200 below the maximum
    (whose exponentials fall below float32's normal range), rescaled block by block."""
    c = _case(4, H=4, n_kv=2, T=256, d=16, P=240)
    kept, pi = c["kept"].copy(), c["pi"]
    kept[0, 32:96] = False  # blocks 2-5 (block=16) hold no key of KV head 0
    bias = np.where(kept, -np.log(pi), -np.inf)
    weight = np.where(kept & (pi < 1), 1 - pi, 0.0)
    k = c["k"].copy()
    scale = 0.25
    u = c["q"][2] + c["q"][3]  # the two heads of KV head 1
    k[1, 100:140] -= 200.0 * u / np.linalg.norm(u)  # these logits fall by 50 q_h . u / |u|
    logits = np.einsum("hd,td->ht", c["q"][2:], k[1]) * scale
    gap = logits[:, 100:140].max(1) - logits.max(1)
    assert (gap < -100).all() and (gap > -600).all()
    out, cert, layer = onepass_attention(
        c["tq"].float(), torch.tensor(k).float(), c["tv"].float(), torch.tensor(bias).float(),
        torch.tensor(weight).float(), scale, gram=c["gram"].float(),
        quad=pair_quadratic_forms(c["tv"].float(), c["gram"].float(), torch.tensor(weight)),
        fixed_size=fixed, block=16)
    assert torch.isfinite(out).all() and torch.isfinite(cert).all() and torch.isfinite(layer)
    for h in range(4):
        g = h // 2
        est = hajek_attention(c["q"][h], k[g], c["v"][g], pi[g], kept[g], scale=scale,
                              variance="trace", design_variance="fixed" if fixed else "poisson")
        np.testing.assert_allclose(out[h].numpy(), est.estimate, rtol=1e-5, atol=1e-6)
        assert float(cert[h]) == pytest.approx(float(est.variance_trace), rel=1e-4, abs=1e-8)
    ref = output_space_certificate(c["q"][:, None, :], k, c["v"], pi, kept, c["W"], scale=scale)
    assert float(layer) == pytest.approx(float(ref.variance_trace[0]), rel=1e-4)


def test_a_positive_infinite_logit_gives_nan_as_the_two_pass_code():
    """A +inf bias (pi = 0 kept) is not mistaken for a masked block, in any block."""
    c = _case(5, H=4, n_kv=2, T=64, d=8, P=60)
    scale = 0.3
    for pos in (5, 60):  # an early block, the last block
        bias = c["bias"].float().clone()
        bias[0, pos] = float("inf")
        out, _, _ = onepass_attention(c["tq"].float(), c["tk"].float(), c["tv"].float(), bias,
                                      c["weight"].float(), scale, block=16)
        logits = torch.einsum("hd,htd->ht", c["tq"].float(),
                              c["tk"].float().repeat_interleave(2, 0)) * scale
        ref = torch.softmax(logits + bias.repeat_interleave(2, 0), -1)
        assert torch.isnan(ref[:2]).all() and torch.isnan(out[:2]).all()
        assert torch.isfinite(out[2:]).all()
