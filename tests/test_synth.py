"""``tracesim synth``: valid stores, exact stored statistics, reproducibility, the model's shape."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from tracesim.app.cli import main as cli_main
from tracesim.store import open_store, validate_store
from tracesim.synth import SynthConfig, write_synthetic_store
from tracesim.synth.attention import causal_attention, weighted_attention_sums
from tracesim.synth.model import CHUNK, N_SINKS, layer_model, queries


def _dense(q, qpos, keys, values, scale):
    s = q @ keys.T * scale
    s[np.arange(keys.shape[0])[None, :] > qpos[:, None]] = -np.inf
    w = np.exp(s - s.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return w, w @ values


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, SynthConfig]:
    cfg = SynthConfig(positions=180, layers=2, sequences=2, decode=16, window=8, question=12,
                      h2o_queries=1000, dtype="float32", seed=7)
    return write_synthetic_store(tmp_path_factory.mktemp("synth") / "s", cfg), cfg


def test_small_store_validates_and_stores_exact_attention(small):
    path, cfg = small
    assert validate_store(path) == []
    store = open_store(path)
    m = store.model
    assert (m.n_heads, m.n_kv_heads, m.head_dim, m.n_layers) == (9, 3, 64, 2)
    assert store.has_o_proj and len(store) == 2
    for seq in store:
        qpos = seq.query_positions
        pl = int(seq.meta["prompt_length"])
        assert seq.query_roles.count("decode") == cfg.decode == seq.n_positions - pl
        for layer in range(m.n_layers):
            lm = layer_model(cfg.seed, layer, m.n_heads, m.n_kv_heads, m.head_dim)
            s_index = int(seq.sequence_id.rsplit("-", 1)[1])
            for h in range(m.n_heads):
                g = h // m.group_size
                k = seq.keys(layer, g).astype(np.float64)
                v = seq.values(layer, g).astype(np.float64)
                _, out = _dense(seq.queries(layer, h).astype(np.float64), qpos, k, v, m.scaling)
                np.testing.assert_allclose(seq.outputs(layer, h), out, rtol=1e-6, atol=1e-6)
                # h2o_queries >= prompt_length: the H2O statistic is exact over every prefill
                # query, regenerated from the model.
                hq = queries(lm, cfg.seed, s_index, layer, h, np.arange(pl), stream=1)
                w, _ = _dense(hq.astype(np.float32).astype(np.float64), np.arange(pl), k, v,
                              m.scaling)
                np.testing.assert_allclose(seq.h2o_scores(layer, h), w.sum(axis=0),
                                           rtol=1e-5, atol=1e-6)


def test_same_seed_gives_a_byte_identical_store(small, tmp_path):
    path, cfg = small
    again = write_synthetic_store(tmp_path / "again", cfg)
    other = write_synthetic_store(tmp_path / "other", SynthConfig(**{**cfg.__dict__, "seed": 8}))

    def digests(root: Path) -> dict[str, str]:
        return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}

    assert digests(path) == digests(again)
    a, b = digests(path), digests(other)
    assert len(a) == len(b) and not set(a.values()) & set(b.values())


def test_replay_runs_on_a_synthetic_store(small, tmp_path):
    path, _ = small
    out = tmp_path / "r"
    assert cli_main(["replay", str(path), "--score", "h2o", "--design", "topk,poisson",
                     "--budget", "0.3", "--seeds", "2", "--layers", "0", "--no-progress",
                     "--out", str(out)]) == 0
    from tracesim.dataset_read import read_results

    table = read_results(out).to_pandas()
    assert len(table) > 0 and np.isfinite(table.err2).all()


def test_blocked_attention_matches_dense():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((12, 8)), rng.standard_normal((50, 8)), rng.standard_normal(
        (50, 8))
    qpos = rng.integers(0, 50, 12)
    w, dense = _dense(q, qpos, k, v, 0.4)
    out, m, lsum = causal_attention(q, qpos, k, v, 0.4, block=7)
    np.testing.assert_allclose(out, dense, rtol=1e-12, atol=1e-13)
    weights = rng.random(6)
    acc = weighted_attention_sums(q, qpos, weights, k, 0.4, m, lsum, 2, block=7)
    expected = np.stack([(w[:6] * weights[:, None]).sum(0), (w[6:] * weights[:, None]).sum(0)])
    np.testing.assert_allclose(acc, expected, rtol=1e-12, atol=1e-13)


def test_generative_model_has_sinks_and_retrieval_spikes(tmp_path):
    """Non-retrieval heads put much of their decode attention on the sinks; retrieval heads'
    decode queries put a single-token spike on a far token, in more than one KV chunk."""
    cfg = SynthConfig(positions=CHUNK + 400, layers=1, decode=8, h2o_queries=64, seed=3)
    path = write_synthetic_store(tmp_path / "long", cfg)
    assert validate_store(path) == []
    store = open_store(path)
    seq = store[store.sequence_ids[0]]
    m = store.model
    lm = layer_model(cfg.seed, 0, m.n_heads, m.n_kv_heads, m.head_dim)
    qpos = seq.query_positions
    dec = np.flatnonzero(qpos >= int(seq.meta["prompt_length"]))
    sink_mass = []
    for h in range(m.n_heads):
        g = h // m.group_size
        k = seq.keys(0, g).astype(np.float64)
        v = seq.values(0, g).astype(np.float64)
        w, out = _dense(seq.queries(0, h).astype(np.float64), qpos, k, v, m.scaling)
        np.testing.assert_allclose(seq.outputs(0, h), out, atol=2e-3)
        wd = w[dec]
        if lm.retrieval[h]:
            top = wd.argmax(axis=1)
            assert (wd.max(axis=1) > 0.5).all()
            assert (top < qpos[dec] - 256).all() and (top >= N_SINKS).all()
        else:
            sink_mass.append(wd[:, :N_SINKS].sum(axis=1).mean())
    # Sink strengths vary by head; on average the four sinks hold a large share of 16k tokens.
    assert np.mean(sink_mass) > 0.2 and max(sink_mass) > 0.5
    assert abs(seq.h2o_scores(0, 0).sum() - int(seq.meta["prompt_length"])) < 1.0


def test_cli_writes_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "c"
    assert cli_main(["synth", "--positions", "200", "--layers", "1", "--out", str(out),
                     "--quiet"]) == 0
    assert cli_main(["validate", str(out)]) == 0
    assert cli_main(["synth", "--positions", "50", "--out", str(tmp_path / "x")]) == 2
    assert "positions" in capsys.readouterr().err
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("x")
    assert cli_main(["synth", "--positions", "200", "--layers", "1",
                     "--out", str(tmp_path / "junk")]) == 2
    assert "not a trace store" in capsys.readouterr().err
