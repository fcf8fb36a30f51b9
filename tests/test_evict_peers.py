"""Peers in the loop: each step's output is the peer's own estimate; rows, resume, bad options."""

import numpy as np
import pytest
import tracesim.capture.inloop.peers as peers_mod
from scipy import special
from tracesim.capture.inloop.peers import decode_peer

from tests.evict_fixtures import prefilled
from tracesim.peers import make_peer, step_inputs
from tracesim.replay import load_layer

pytestmark = pytest.mark.capture

PEERS = [("magicpig", {}), ("vattention", {"local": 8, "heavy": 0.05, "base_rate": 0.1}),
         ("quest", {"budget": 0.3})]


@pytest.mark.parametrize(("name", "params"), PEERS)
def test_first_step_output_is_the_peers_estimate_on_the_stored_query(monkeypatch, tiny_store,
                                                                     name, params):
    """Layer 0's first decode query is the full-cache one, so the in-loop output there is what
    the peer's own replay computes on the stored trace."""
    store, loaded, seq, meta, P, pre = prefilled(tiny_store)
    peer = make_peer(name, **params)
    first = {}

    class Probe(peers_mod.PeerState):
        def attend(self, layer, query, key, value, scaling):
            out = super().attend(layer, query, key, value, scaling)
            if out is not None and layer not in first:
                first[layer] = out[0, 0].double().numpy()
            return out

    monkeypatch.setattr(peers_mod, "PeerState", Probe)
    res = decode_peer(loaded.model, pre, peer, 3, set(), seed=2)
    assert res.step_positions == [P, P + 1] and not res.certificates
    trace = load_layer(store, seq, 0)
    qi = int(np.flatnonzero(trace.query_positions == P)[0])
    z = float(special.ndtri(0.975))
    for h in range(trace.n_heads):
        x = step_inputs(trace, h, qi)
        state = peer.prepare(0, x.kv_head, trace.keys[x.kv_head], P, 2)
        want = peer.attend(x, state, 2, z)[1]
        np.testing.assert_allclose(first[0][h], want, atol=2e-5)
    union = res.step_kept[0]
    assert union.shape == (store.model.n_layers, store.model.n_kv_heads, P)


def test_run_evict_with_peers_writes_rows_and_full_quest_is_the_full_cache(tiny_store, tmp_path):
    import pyarrow.parquet as pq
    from tracesim.capture.inloop.evict_run import run_evict

    from tracesim.policies import make_policy

    path, loaded = tiny_store
    # Quest keeps floor(tokens / page) pages: with one position per page, budget 1 is all.
    peers = [make_peer("magicpig"), make_peer("quest", page=1, budget=1.0)]
    out = tmp_path / "o"
    summary = run_evict(path, [make_policy("full")], seeds=2, out=out, model=loaded,
                        progress=False, peers=peers)
    df = pq.read_table(out / "outcomes.parquet").to_pandas()
    assert summary["n_rows"] == len(df) == 2 * (1 + 2 + 1)
    assert set(df.config_id) == {"full", peers[0].label(), peers[1].label()}
    quest = df[df.design == "quest"]
    assert (quest.score == "peer").all() and quest.same_tokens_as_full.all()
    assert (quest.step_tokens_fraction == 1).all() and (quest.step_rows_read > 0).all()
    pig = df[df.design == "magicpig"]
    assert (pig.step_tokens_fraction < 1).all() and pig.certificate_mean.isna().all()
    assert sorted(pig.seed.unique().tolist()) == [0, 1]
    plain = run_evict(path, [make_policy("full")], seeds=2, out=out, model=loaded,
                      progress=False)
    assert plain["run_key"] != summary["run_key"] and plain["n_rows"] == 2
    again = run_evict(path, [make_policy("full")], seeds=2, out=out, model=loaded,
                      progress=False, peers=peers)
    assert again["sequences_skipped"] == 2 and again["n_rows"] == len(df)


@pytest.mark.parametrize(("args", "field"), [
    (["--peer", "quest", "--peer-params", '{"quest": {"page": 0}}'], "page"),
    (["--peer", "nope"], "nope"),
    (["--peer-params", '{"quest": {}}'], "--peer-params"),
    # the per-step options are laid over the grid file: a grid without perstep refuses them
    (["--proxy", "quant:4"], "--proxy"),
    (["--score-params", '{"snapkv": {"window": 4}}'], "--score-params")])
def test_bad_peer_options_exit_2_naming_the_field(tiny_store, tmp_path, capsys, args, field):
    from tracesim.app.cli import main

    path, _ = tiny_store
    grid = tmp_path / "g.yaml"
    grid.write_text("grid:\n  score: [full]\nseeds: 1\n")
    assert main(["evict", str(path), "--grid", str(grid), "--out", str(tmp_path / "o"),
                 *args]) == 2
    assert field in capsys.readouterr().err
