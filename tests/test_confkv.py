"""Conf-KV in the loop: its confidence -> budget rule and its kept sets against loop references,
full budget as the full cache, and the same on a tiny Gemma 3 (sliding layers)."""

import json
import math

import numpy as np
import pytest
import torch
from tracesim.capture.inloop.confkv import ConfKV, budget_tokens, confidence
from tracesim.capture.inloop.confkv_loop import ConfKVConfig, ConfKVState, decode_confkv
from tracesim.capture.inloop.evict import decode_policy, prefill_sequence

from tracesim.policies import make_policy

pytestmark = pytest.mark.capture


def _confidence_loop(logits):
    """Loop reference: mean of 1 - H/log V, p1 and 1 - p2/p1."""
    m = max(logits)
    e = [math.exp(x - m) for x in logits]
    s = sum(e)
    p = [x / s for x in e]
    h = 0.0
    for x in p:
        if x > 0:
            h -= x * math.log(x)
    p1 = max(p)
    rest = list(p)
    rest.remove(p1)
    p2 = max(rest)
    return ((1 - h / math.log(len(p))) + p1 + (1 - p2 / p1)) / 3


def test_confidence_and_budget_follow_the_rule():
    rng = np.random.default_rng(0)
    for scale in (0.1, 1.0, 5.0, 30.0):
        z = rng.normal(size=50) * scale
        assert confidence(z) == pytest.approx(_confidence_loop(list(z)), abs=1e-12)
    # uniform: no entropy gap and no margin, only the top-1 mass 1/V
    assert confidence(np.zeros(10)) == pytest.approx(0.1 / 3, abs=1e-12)
    assert confidence(np.array([0.0, -1e4, -1e4])) == pytest.approx(1.0)
    cfg = ConfKV(budget_min=0.1, budget_max=0.5, window=4)
    assert cfg.share(1.0) == pytest.approx(0.1) and cfg.share(0.0) == pytest.approx(0.5)
    assert cfg.share(0.25) == pytest.approx(0.4)
    assert budget_tokens(0.1, 100, 4) == 10 and budget_tokens(0.01, 100, 4) == 4
    assert budget_tokens(0.5, 3, 4) == 3
    assert ConfKV("fixed", budget=0.3).share(0.9) == 0.3


@pytest.mark.parametrize(("fields", "word"), [
    ({"mode": "h2o"}, "mode"), ({"budget_min": 0.6, "budget_max": 0.5}, "budget_min"),
    ({"budget": 0.2}, "budget"), ({"mode": "fixed"}, "budget"), ({"window": -1}, "window"),
    ({"alpha": 1.5}, "alpha"), ({"ema": 1.0}, "ema"), ({"budget_max": 0}, "budget_max")])
def test_fields_are_validated(fields, word):
    with pytest.raises(ValueError, match=word):
        ConfKV(**fields)


class _Probe(ConfKVState):
    """Records, per decode step and layer, the state before and after the eviction and the
    step's attention inputs."""

    def __init__(self, prefill, config):
        super().__init__(prefill, config)
        self.logits_seen, self.log = [], []

    def set_logits(self, logits):
        self.logits_seen.append(logits.double().numpy().copy())
        super().set_logits(logits)

    def before_attention(self, layer, query, key, value):
        if query.shape[2] == 1 and key.shape[2] > self.prompt_length:
            self._grow(layer, key.shape[2])
            entry = {"layer": layer, "t": key.shape[2] - 1, "share": self._share,
                     "alive": self.alive[layer].copy(), "mass": self.mass[layer].copy(),
                     "window": self.rule(layer).window}
            super().before_attention(layer, query, key, value)
            entry.update(after=self.alive[layer].copy(), q=query[0, :, 0].double().numpy(),
                         k=key[0].double().numpy(), v=value[0].double().numpy())
            self.log.append(entry)
        else:
            super().before_attention(layer, query, key, value)

    def record(self, layer, query, key, value, output, mask, scaling):
        super().record(layer, query, key, value, output, mask, scaling)
        if query.shape[2] == 1 and key.shape[2] > self.prompt_length:
            self.log[-1].update(out=output[0, 0].double().numpy(),
                                mass_after=self.mass[layer].copy(), scaling=scaling)


def _reference_step(entry, cfg, n_kv):
    """Loop reference of one step's eviction: the kept flags after it."""
    t, w = entry["t"], entry["window"]
    lo = 0 if w is None else max(0, t - w + 1)
    n = t - lo
    protected = [i >= t - cfg.window or i < cfg.sinks for i in range(lo, t)]
    k = budget_tokens(entry["share"], n, sum(protected))
    alive = entry["alive"].copy()
    for g in range(n_kv):
        mass = entry["mass"][g]
        while sum(alive[g, lo:t]) > k:
            best, best_key = None, None
            top = max(mass[lo:t])
            for i in range(lo, t):
                if not alive[g, i] or protected[i - lo]:
                    continue
                if cfg.mode == "streaming":
                    s = i
                else:
                    s = cfg.alpha * (mass[i] / top if top > 0 else 0.0) + (
                        1 - cfg.alpha) * (i - lo + 1) / n
                if best_key is None or (s, i) < best_key:
                    best, best_key = i, (s, i)
            alive[g, best] = False
    return alive


def _tiny(arch, seed=3):
    from tracesim.capture.models import tiny_model

    return tiny_model(arch, seed=seed).double()


def _prefill(model, P=48, seed=1):
    ids = np.random.default_rng(seed).integers(3, 250, size=P).tolist()
    return ids, prefill_sequence(model, ids, question_start=P - 8, window=4,
                                 scaling=_scaling(model))


def _scaling(model):
    from tracesim.capture.attention import attention_modules

    return float(attention_modules(model)[0].scaling)


@pytest.mark.parametrize(("arch", "cfg"), [
    ("llama", ConfKV(budget_min=0.2, budget_max=0.6, window=4)),
    ("llama", ConfKV("fixed", budget=0.3, window=4, alpha=0.7)),
    ("llama", ConfKV.streaming(0.25, window=4, sinks=2)),
    ("gemma3", ConfKV(budget_min=0.3, budget_max=0.8, window=2))])
def test_kept_sets_budgets_and_outputs_equal_the_loop_reference(monkeypatch, arch, cfg):
    import tracesim.capture.inloop.confkv_loop as loop_mod

    model = _tiny(arch)
    _, pre = _prefill(model)
    states = []

    class Probe(_Probe):
        def __init__(self, prefill, config):
            super().__init__(prefill, config)
            states.append(self)

    monkeypatch.setattr(loop_mod, "ConfKVState", Probe)
    res = decode_confkv(model, pre, cfg, 6, set())
    state = states[0]
    assert len(res.generated_ids) == 6 and len(state.logits_seen) == 5
    for logits, share in zip(state.logits_seen, state.shares, strict=True):
        assert share == pytest.approx(cfg.share(_confidence_loop(list(logits))), abs=1e-12)
    n_kv = pre.traces[0].n_kv_heads
    assert len(state.log) == 5 * len(pre.traces)
    evicted = 0
    for entry in state.log:
        ref = _reference_step(entry, cfg, n_kv)
        np.testing.assert_array_equal(entry["after"], ref)
        evicted += int((~ref).sum())
        # the step attends to exactly the kept tokens (and its window), in float64
        t, w = entry["t"], entry["window"]
        q, k, v = entry["q"], entry["k"], entry["v"]
        G = q.shape[0] // n_kv
        allowed = np.append(ref[:, :t], np.ones((n_kv, 1), bool), axis=1)
        if w is not None:
            allowed[:, :max(0, t - w + 1)] = False
        for h in range(q.shape[0]):
            g = h // G
            s = k[g] @ q[h] * entry["scaling"]
            s[~allowed[g]] = -np.inf
            a = np.exp(s - s.max())
            a /= a.sum()
            np.testing.assert_allclose(entry["out"][h], a @ v[g], atol=1e-10)
    assert evicted > 0  # the budgets bite
    kept = np.stack(state.step_kept).mean(axis=0)
    np.testing.assert_allclose(res.kept_tokens, kept)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_full_budget_reproduces_the_models_logits(arch):
    """At budget 1 the in-loop paths (Conf-KV, and one-shot eviction) decode the model's own
    greedy tokens, with the log-probabilities of an independent forward of the model."""
    from tracesim.capture.models import tiny_model

    model = tiny_model(arch, seed=5).float()
    P, n = 40, 8
    ids, pre = _prefill(model, P, seed=2)
    full = ConfKV(budget_min=1.0, budget_max=1.0, window=2)
    res = decode_confkv(model, pre, full, n, set())
    one_shot = decode_policy(model, pre, {}, n, set(), make_policy("snapkv", "topk", 1.0), 0)
    reference = tiny_model(arch, seed=5, attn_implementation="eager").float()
    with torch.no_grad():
        seq = torch.tensor([ids + res.generated_ids[:-1]])
        logp = torch.log_softmax(reference(seq).logits[0, P - 1:].double(), dim=-1)
    expected = logp.argmax(dim=-1).tolist()
    assert res.generated_ids == expected == one_shot.generated_ids
    chosen = logp[torch.arange(n), torch.tensor(expected)].numpy()
    np.testing.assert_allclose(res.logprobs, chosen, atol=2e-4)
    np.testing.assert_allclose(one_shot.logprobs, chosen, atol=2e-4)
    # every layer keeps all it holds: [0, t), or the window on a sliding layer
    pop = np.stack(res.confkv_state.step_population)
    np.testing.assert_array_equal(np.stack(res.step_kept), pop)
    if arch == "gemma3":
        assert pre.traces[0].window == 8 and pre.traces[1].window is None
        assert pop[0, 0, 0] == 7 and pop[0, 1, 0] == P


def test_rows_name_the_family():
    row = ConfKVConfig(ConfKV("fixed", budget=0.25)).row()
    assert row["score"] == "confkv_fixed" and row["budget"] == 0.25
    assert ConfKVConfig(ConfKV()).row()["score"] == "confkv"
    assert ConfKVConfig(ConfKV.streaming(0.2)).row()["sinks"] == 4


def test_evict_runs_the_family_besides_the_grid(tiny_store, tmp_path):
    import pyarrow.parquet as pq
    from tracesim.capture.inloop.evict_run import run_evict

    path, loaded = tiny_store
    family = [ConfKV(window=4), ConfKV("fixed", budget=0.3, window=4),
              ConfKV.streaming(0.3, window=4)]
    out = tmp_path / "o"
    summary = run_evict(path, [make_policy("full")], seeds=1, out=out, model=loaded,
                        progress=False, confkv=family)
    df = pq.read_table(out / "outcomes.parquet").to_pandas()
    assert summary["n_rows"] == len(df) == 2 * 4
    assert set(df.score) == {"full", "confkv", "confkv_fixed", "streaming"}
    assert (df.model_id == "tiny-llama").all() and df.seed.isna().all()
    fam = df[df.score != "full"]
    assert (fam.kept_tokens_mean < fam.prompt_length).all()
    fixed = fam[fam.score == "confkv_fixed"]
    # a fixed share keeps round(0.3 t) of the t tokens of [0, t) at every step
    assert np.allclose(fixed.kept_tokens_mean / (fixed.prompt_length + (fixed.n_generated - 2)
                                                 / 2), 0.3, atol=0.01)


@pytest.mark.parametrize(("names", "params", "word"), [
    ("confkv,h2o", "{}", "h2o"), ("fixed", "{}", "budget"),
    ("confkv", '{"fixed": {"budget": 0.2}}', "fixed"),
    ("confkv", '{"confkv": {"bogus": 1}}', "bogus"), (None, '{"confkv": {}}', "--confkv")])
def test_cli_values_exit_2_naming_the_field(names, params, word):
    from tracesim.capture.inloop.confkv_loop import confkv_from_cli

    from tracesim.errors import UsageError

    with pytest.raises(UsageError, match=word):
        confkv_from_cli(names, params)
    cfgs = confkv_from_cli("confkv,fixed,streaming",
                           '{"fixed": {"budget": 0.2}, "streaming": {"budget": 0.2}}')
    assert [c.mode for c in cfgs] == ["confkv", "fixed", "streaming"] and cfgs[2].sinks == 4


def test_c12_study_matches_the_twin_and_merges_into_signed_outcomes(tiny_store, tmp_path):
    from tracesim.analysis.results_io import load_outcomes
    from tracesim.capture.inloop.confkv_study import merge, run_c12

    path, loaded = tiny_store
    summary = run_c12(path, loaded, tmp_path / "a", confkv=ConfKV(window=4), progress=False)
    share = summary["matched_share"]
    assert 0.1 <= share <= 0.5
    merged = merge(tmp_path / "m", [tmp_path / "a"])
    df, signed = load_outcomes(tmp_path / "m")
    assert merged["n_rows"] == len(df) == 2 * 3 and signed["n_rows"] == 6
    assert df.sequence_id.str.startswith("tiny-llama/").all()
    by = df.groupby("score").kept_tokens_mean.mean()
    # the twin keeps, on average, what Conf-KV kept (rounding of the share per step aside)
    assert abs(by["confkv_fixed"] / by["confkv"] - 1) < 0.05
    assert abs(by["streaming"] / by["confkv"] - 1) < 0.05
    # the CLI reports the merged outcomes alone: C12 reads them, the results claims do not
    from tracesim.analysis.claims import INPUT_MISSING

    from tracesim.app.cli import main as cli_main

    rc = cli_main(["report", "--outcomes-only", str(tmp_path / "m"), "--out",
                   str(tmp_path / "r")])
    assert rc == 0
    saved = {c["claim"]: c for c in json.loads((tmp_path / "r" / "claims.json").read_text())}
    assert saved["C1"]["verdict"] == "not evaluated"
    assert saved["C12"]["detail"] != INPUT_MISSING["outcomes"]
    assert cli_main(["report", "--out", str(tmp_path / "r2")]) == 2
