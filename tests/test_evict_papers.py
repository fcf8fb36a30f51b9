"""VaSE and head roles in the loop (``tracesim evict``): the model keeps the simulator's sets."""

import numpy as np
import pytest
from tracesim.capture.inloop.evict import decode_policy, layer_plans

from tests.evict_fixtures import prefilled
from tracesim.policies import make_policy
from tracesim.replay import load_layer
from tracesim.replay.kept import first_event_inclusion

pytestmark = pytest.mark.capture


@pytest.mark.parametrize(("score", "design", "params"), [
    ("vase", "topk", {"temperature": 1.0, "value_share": 0.1}),
    ("vase", "poisson", {"temperature": 0.0}),
    ("headroles", "poisson", {"threshold": 0.2, "streaming_tail": 4}),
])
def test_papers_policies_run_in_the_loop_with_the_simulators_kept_sets(
        tiny_store, score, design, params):
    store, loaded, seq, meta, P, pre = prefilled(tiny_store)
    policy = make_policy(score, design, 0.4, score_params={"window": 8, **params})
    seed = 3
    plans = layer_plans(pre.traces, policy, seed)
    res = decode_policy(loaded.model, pre, plans, 2, set())
    assert len(res.generated_ids) == 2
    for layer in range(store.model.n_layers):
        pi_sim, kept_sim = first_event_inclusion(load_layer(store, seq, layer), policy, seed,
                                                 store.model.n_layers)
        np.testing.assert_array_equal(plans[layer].kept.numpy(), kept_sim[:, :P])
        np.testing.assert_allclose(plans[layer].pi.numpy(), pi_sim[:, :P], rtol=1e-12)


def test_tangram_runs_in_the_loop_with_a_calibrated_profile(tiny_store, tmp_path):
    from tracesim.policies.tangram import save_tangram_profile
    from tracesim.replay.calibrate import calibrate_tangram

    store, loaded, seq, meta, P, pre = prefilled(tiny_store)
    ratios = calibrate_tangram(store, "h2o", 0.4, window=8)
    save_tangram_profile(tmp_path / "profile.npz", ratios)
    policy = make_policy("tangram", "poisson", 0.4, score_params={
        "window": 8, "profile": str(tmp_path / "profile.npz")})
    plans = layer_plans(pre.traces, policy, 1)
    assert len(decode_policy(loaded.model, pre, plans, 2, set()).generated_ids) == 2
    for layer in range(store.model.n_layers):
        _, kept_sim = first_event_inclusion(load_layer(store, seq, layer), policy, 1,
                                            store.model.n_layers)
        np.testing.assert_array_equal(plans[layer].kept.numpy(), kept_sim[:, :P])
