"""Per-query-head samples of per-step designs (``perstep`` with ``gqa: head``).

Ground truth: a loop reference of the rule for every query head and step (its own proxy
softmax over ``[0, t]``, take-all = sinks + window + top-h, capped PPS with the defensive
mixture on the rest, the PRN uniforms keyed by the query head), the textbook Hájek estimate,
certificate and output-space certificate of independent per-head samples, and equality with
``gqa: mean`` where the group has one head.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import yaml

from tests.reference import capped_pps_iterative, full_attention_reference, hajek_reference
from tests.replay_fixtures import assert_same_on_one_and_two_threads, build_store, synthetic_trace
from tracesim.kernels import replay as K
from tracesim.policies import make_policy, make_score
from tracesim.policies.grid import SpecError, expand_grid
from tracesim.prn import STREAM_INCLUSION, permanent_uniforms, step_stream
from tracesim.proxies import make_proxy
from tracesim.replay import layer_batch, replay, replay_layer, replay_layer_runs
from tracesim.replay.engine import layout_runs
from tracesim.store import open_store

MIXTURE = 0.1
PROXIES = ("exact", "quant:4", "simhash:4,32")


def _policy(gqa: str, proxy: str = "exact", schedule: str = "step", budget: float = 0.3,
            design: str = "poisson"):
    return make_policy("perstep", design, budget, schedule=schedule,
                       design_params={"mixture": MIXTURE} if design == "poisson" else None,
                       score_params={"proxy": proxy, "window": 8, "gqa": gqa})


@pytest.fixture(scope="module")
def trace():
    """9 query heads on 3 KV heads (G = 3, SmolLM2's grouping), d = 8."""
    return synthetic_trace(11, n_heads=9, n_kv=3, d=8, P=96, prompt_length=80)


def _decode_index(trace, t: int) -> int:
    return int(np.flatnonzero((trace.query_positions == t)
                              & (np.array(trace.query_roles) == "decode"))[0])


def reference_pi(trace, policy, h: int, t: int) -> np.ndarray:
    """The rule for query head ``h`` at the step at ``t``, by loops: pi over ``[0, t)``."""
    score = policy.score
    g = h // trace.group_size
    q = trace.queries[h, _decode_index(trace, t)]
    s = np.empty(t + 1)
    s[:t] = make_proxy(score.proxy).logits(trace, g, q[None], t)[0]
    s[t] = sum(q[k] * trace.keys[g, t, k] for k in range(q.size)) * trace.scale
    a = np.exp(s - s.max())
    a /= a.sum()
    x = a[:t]
    take = np.zeros(t, dtype=bool)
    take[:score.sinks] = True
    take[t - score.window:] = True
    n = policy.budget.tokens(t) - int(take.sum())
    tail = [i for i in range(t) if not take[i]]
    h_top = int(round(score.top_fraction * n))
    ranked = sorted(tail, key=lambda i: (-x[i], -i))  # largest first; the later among ties
    rest = [i for i in tail if i not in set(ranked[:h_top])]
    pi = np.ones(t)
    xr = x[rest] / x[rest].max()
    xr = (1 - MIXTURE) * xr / xr.sum() + MIXTURE / len(rest)
    pi[rest] = capped_pps_iterative(xr, n - h_top)
    return pi


def _uniforms(policy, seed: int, h: int, t: int) -> np.ndarray:
    stream = step_stream(t) if policy.schedule.fresh else STREAM_INCLUSION
    return permanent_uniforms(seed, 0, h, np.arange(t), stream=stream)


@pytest.mark.parametrize("schedule", ["step", "step:permanent"])
@pytest.mark.parametrize("proxy", PROXIES)
def test_each_query_head_has_its_own_pi_and_kept_set(trace, proxy, schedule):
    pol = _policy("head", proxy, schedule)
    seeds = np.array([0, 5])
    res = replay_layer(trace, [pol], seeds, n_layers=2)
    tab, view = res.tables, res.trace
    assert view.source is trace and view.n_kv_heads == trace.n_heads == 9
    H, G, W = trace.n_heads, trace.group_size, trace.o_proj
    qev = tab.query_event(0)
    for a, t in enumerate(res.query_positions.tolist()):
        e = int(qev[a])
        assert tab.tau[e] == t
        pis = []
        for h in range(H):
            pi_ref = reference_pi(trace, pol, h, t)
            np.testing.assert_allclose(tab.pi[e, h, :t], pi_ref, rtol=1e-10, atol=1e-13)
            assert (tab.pi[e, h, t:] == 1).all()
            assert tab.budget_tokens[e, h] == pol.budget.tokens(t)
            pis.append(pi_ref)
        assert not np.allclose(pis[0], pis[1])  # heads of one group are sampled apart
        for it, s in enumerate(tab.it_seed.tolist()):
            seed = int(seeds[s])
            ests, truths, lcert = [], [], 0.0
            for h in range(H):
                g = h // G
                pi = np.append(pis[h], 1.0)  # the current token is always kept
                kept = np.append(_uniforms(pol, seed, h, t) < pis[h], True)
                keys, vals = trace.keys[g, :t + 1], trace.values[g, :t + 1]
                q = trace.queries[h, _decode_index(trace, t)]
                est, V, m = hajek_reference(q, keys, vals, pi, kept, trace.scale)
                truth = full_attention_reference(q, keys, vals, trace.scale)
                o = res.out[it, h, a]
                assert o[K.F_KEPT] == kept[:t].sum() and o[K.F_TAIL] == m
                np.testing.assert_allclose(o[K.F_EXPECTED], pis[h].sum(), rtol=1e-12)
                np.testing.assert_allclose(o[K.F_ERR2], (est - truth) @ (est - truth),
                                           rtol=1e-9, atol=1e-14)
                np.testing.assert_allclose(o[K.F_CERT2], np.trace(V), rtol=1e-9, atol=1e-14)
                ests.append(est)
                truths.append(truth)
                # Independent samples: the layer certificate has no cross-head term.
                idx = np.flatnonzero(kept)
                sc = keys[idx] @ q * trace.scale - np.log(pi[idx])
                w = np.exp(sc - sc.max())
                w /= w.sum()
                Wh = W[:, h * 8:(h + 1) * 8]
                for j, i in enumerate(idx):
                    if pi[i] < 1:
                        vec = w[j] * Wh @ (vals[i] - est)
                        lcert += (1 - pi[i]) * vec @ vec
            delta = W @ (np.concatenate(ests) - np.concatenate(truths))
            np.testing.assert_allclose(res.lout[it, a, K.L_ERR2], delta @ delta, rtol=1e-9)
            np.testing.assert_allclose(res.lout[it, a, K.L_CERT2], lcert, rtol=1e-9)


@pytest.mark.parametrize("proxy", PROXIES)
def test_group_of_one_head_gives_mean_bit_for_bit(proxy):
    mha = synthetic_trace(5, n_heads=3, n_kv=3, d=8, P=96, prompt_length=80)
    assert mha.per_query_head() is mha
    seeds = np.array([2, 7])
    for schedule in ("step", "step:permanent"):
        mean, head = _policy("mean", proxy, schedule), _policy("head", proxy, schedule)
        a = replay_layer(mha, [mean], seeds, n_layers=2)
        b = replay_layer(mha, [head], seeds, n_layers=2)
        assert a.tables.pi.tobytes() == b.tables.pi.tobytes()
        assert a.out.tobytes() == b.out.tobytes() and a.lout.tobytes() == b.lout.tobytes()
        ta, tb = layer_batch(a).to_pandas(), layer_batch(b).to_pandas()
        same = [c for c in ta.columns if c not in ("config_id", "score_params")]
        pd.testing.assert_frame_equal(ta[same], tb[same], check_exact=True)
        assert len(layout_runs(mha, [mean, head])) == 1  # one layout when G = 1


def test_full_budget_gives_zero_error(trace):
    pols = [_policy("head", p, s, budget=1.0) for p in PROXIES
            for s in ("step", "step:permanent")]
    res = replay_layer(trace, pols, np.arange(2), n_layers=2)
    assert np.abs(res.out[..., K.F_ERR2]).max() < 1e-20
    assert np.abs(res.lout[..., K.L_ERR2]).max() < 1e-20


def test_bit_identical_across_threads(trace):
    pols = [_policy("head", p, s) for p in ("quant:4", "simhash:4,32")
            for s in ("step", "step:permanent")]
    assert_same_on_one_and_two_threads(trace, pols, np.array([3, 1, 4]))


def test_mixed_lists_replay_in_runs_and_rows_name_the_stored_kv_head(trace, tmp_path):
    pols = [_policy("mean"), _policy("head"), _policy("max"), _policy("head", "quant:4")]
    with pytest.raises(ValueError, match="replay_layer_runs"):
        replay_layer(trace, pols, np.arange(2), n_layers=2)
    runs = replay_layer_runs(trace, pols, np.arange(2), n_layers=2)
    assert [[p.id for p in r.policies] for r in runs] == [[pols[0].id], [pols[1].id],
                                                           [pols[2].id], [pols[3].id]]
    assert [r.trace.n_kv_heads for r in runs] == [3, 9, 3, 9]
    for run, p in zip(runs, pols, strict=True):  # a policy's results do not depend on its run
        alone = replay_layer(trace, [p], np.arange(2), n_layers=2)
        assert run.out.tobytes() == alone.out.tobytes()
    # Through a store: rows in the order of the policies, kv_head of the stored layer.
    store = open_store(build_store(tmp_path / "store", n_seqs=1, n_layers=1, n_heads=4,
                                   n_kv=2))
    df = replay(store, pols[:2], seeds=2, progress=False).to_pandas()
    assert df.config_id.drop_duplicates().tolist() == [pols[0].id, pols[1].id]
    assert (df.kv_head == df["head"] // 2).all()
    head_rows = df[df.config_id == pols[1].id]
    assert (head_rows.budget_tokens == [pols[1].budget.tokens(int(t))
                                        for t in head_rows.query_position]).all()


def test_bad_gqa_values_and_schedules_name_the_field(trace):
    with pytest.raises(ValueError, match="gqa"):
        make_score("perstep", gqa="median")
    with pytest.raises(ValueError, match="gqa = 'head'.*schedule 'step'"):
        make_policy("perstep", "poisson", 0.3, score_params={"gqa": "head"})
    with pytest.raises(ValueError, match="gqa"):
        make_policy("snapkv", "poisson", 0.3, score_params={"gqa": "head"})
    with pytest.raises(SpecError, match=r"gqa: head\) x oneshot"):
        expand_grid({"score": ["perstep"], "design": ["poisson"], "budget": [0.3],
                     "schedule": ["oneshot"], "score_params": {"perstep": {"gqa": ["head"]}}})
    # Scoring a stored GQA layer directly is refused: a sample per query head needs the view.
    with pytest.raises(ValueError, match="per_query_head"):
        make_score("perstep", gqa="head", window=8).scores(trace, 0,
                                                           int(trace.query_positions[-1]))


@pytest.mark.parametrize(("grid", "field"), [
    ("score: [perstep]\n  design: [poisson]\n  budget: [0.3]\n  schedule: [oneshot]\n"
     "  score_params: {perstep: {gqa: [head]}}", "gqa: head"),
    ("score: [snapkv]\n  design: [poisson]\n  budget: [0.3]\n"
     "  score_params: {snapkv: {gqa: [head]}}", "gqa"),
    ("score: [perstep]\n  design: [poisson]\n  budget: [0.3]\n  schedule: [step]\n"
     "  score_params: {perstep: {gqa: [median]}}", "gqa")])
def test_bad_gqa_options_exit_2_in_the_sweep_cli(tmp_path, capsys, grid, field):
    from tracesim.app.cli import main

    build_store(tmp_path / "store", n_seqs=1, n_layers=1)
    (tmp_path / "spec.yaml").write_text(f"name: bad\nstore: store\nlayers: all\ngrid:\n  {grid}\n"
                                        "seeds: 1\noutput: out\n")
    assert main(["sweep", str(tmp_path / "spec.yaml"), "--dry-run", "--no-calibrate"]) == 2
    assert field in capsys.readouterr().err


def test_evict_refuses_per_query_head_samples(tmp_path, capsys):
    from tracesim.app.cli import main

    path = build_store(tmp_path / "store", n_seqs=1, n_layers=1)
    grid = tmp_path / "grid.yaml"
    grid.write_text("grid:\n  score: [perstep]\n  budget: [0.3]\n  schedule: [step]\n"
                    "  design: [poisson]\n  score_params: {perstep: {gqa: [head]}}\nseeds: 1\n")
    assert main(["evict", str(path), "--grid", str(grid), "--out", str(tmp_path / "o")]) == 2
    assert "gqa" in capsys.readouterr().err


SPEC = """\
name: gqa-head
store: store
layers: all
grid:
  score: [perstep]
  design: [poisson]
  budget: [0.3]
  schedule: [step, "step:permanent"]
  score_params:
    perstep: {gqa: [mean, head], proxy: [exact, "quant:4"], window: 6}
  design_params:
    poisson: {mixture: 0.1}
seeds: 2
output: out
"""


def test_sweep_grid_crosses_gqa_and_is_identical_on_one_and_two_workers(tmp_path):
    from tests.sweep_fixtures import build_sweep_store
    from tracesim.sweep import load_spec, run_sweep

    build_sweep_store(tmp_path / "store", n_seqs=2, n_layers=1)
    (tmp_path / "spec.yaml").write_text(SPEC)
    spec = load_spec(tmp_path / "spec.yaml")
    gqa = sorted(p.score.gqa for p in spec.policies)
    assert gqa == ["head"] * 4 + ["mean"] * 4
    keys = ["sequence_id", "layer", "config_id", "head", "query_index"]

    def rows(out):
        df = pd.read_parquet(out / "results" / "parts")
        return df.sort_values(keys).reset_index(drop=True)

    one = run_sweep(tmp_path / "spec.yaml", workers=1, out=tmp_path / "one", progress=False)
    two = run_sweep(tmp_path / "spec.yaml", workers=2, threads_per_worker=1,
                    out=tmp_path / "two", progress=False)
    assert one.complete and two.complete and two.workers == 2
    pd.testing.assert_frame_equal(rows(tmp_path / "one"), rows(tmp_path / "two"),
                                  check_exact=True)
    direct = replay(open_store(tmp_path / "store"), list(spec.policies), seeds=2,
                    progress=False).to_pandas()
    ref = rows(tmp_path / "one").drop(columns=["store", "model_id"])
    pd.testing.assert_frame_equal(ref, direct.sort_values(keys).reset_index(drop=True),
                                  check_exact=True)
    assert set(ref.score_params.map(lambda s: yaml.safe_load(s)["gqa"])) == {"mean", "head"}


def test_perstep_table_labels_gqa_and_costs_count_each_heads_rows():
    from tracesim.analysis.perstep import perstep_table
    from tracesim.analysis.perstep_costs import cost_columns

    rows = []
    for gqa, kept in (("mean", 100), ("head", 90)):
        pol = make_policy("perstep", "poisson", 0.25, schedule="step",
                          score_params={"proxy": "quant:4", "gqa": gqa})
        for h in range(6):  # 6 query heads, 2 KV heads (G = 3)
            rows.append({**pol.row(), "sequence_id": "s", "head": h, "kv_head": h // 3,
                         "kept_tokens": kept, "n_positions": 400, "wald_cov": 1.0,
                         "wald_t_cov": 1.0, "err2": 1.0, "cert2": 1.0})
    table = cost_columns(perstep_table(pd.DataFrame(rows), 8), pd.DataFrame(rows), head_dim=8)
    t = table.set_index("gqa")
    assert t.loc["mean", "read_rows"] == (100 - 36) * 2  # kept_tokens excludes the current token
    assert t.loc["head", "read_rows"] == 3 * (90 - 36) * 2  # G x the per-head rows
    assert t.loc["head", "hbm_kib"] == t.loc["mean", "hbm_kib"]  # same proxy, same stratum


def test_tiny_replay_of_the_held_out_grid_entry(tmp_path):
    """The ``gqa: head`` entry of ``data/sweeps/perstep-heldout.yaml``, as it is, on a test
    store (9 query heads on 3 KV heads, 40 decode steps)."""
    doc = yaml.safe_load(open("data/sweeps/perstep-heldout.yaml"))
    entry = [g for g in doc["grid"] if g.get("score_params", {}).get("perstep", {}).get("gqa")]
    assert len(entry) == 1 and entry[0]["score_params"]["perstep"]["gqa"] == ["head"]
    policies = expand_grid(entry[0]).policies
    assert len(policies) == 2 and all(p.score.per_query_head for p in policies)
    store = open_store(build_store(tmp_path / "store", n_seqs=1, n_layers=1, n_heads=9,
                                   n_kv=3, P=400, prompt_length=360))
    df = replay(store, policies, seeds=4, progress=False).to_pandas()
    assert len(df) == 2 * 9 * 40
    assert df.wald_cov.between(0, 1).all() and (df.err2 > 0).all()
    assert (df.kv_head == df["head"] // 3).all()
