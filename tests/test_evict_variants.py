"""In-loop eviction on sliding layers, soft-caps and sinks (issue 29): at full budget the loop
reproduces the model's own logits; on a sliding layer the one-pass decode folds the window in
exactly as the model's mask does; what is not implemented is refused before decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tracesim.capture.attention import attention_modules
from tracesim.capture.inloop.evict import decode_policy, layer_plans, prefill_sequence
from tracesim.capture.models import set_attention, tiny_model

from tracesim.policies import make_policy

pytestmark = pytest.mark.capture

PROMPT_LEN, N_NEW = 24, 5


def _prompt() -> list[int]:
    return torch.randint(0, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(4)).tolist()


def _prefill(model, prompt):
    return prefill_sequence(model, prompt, question_start=PROMPT_LEN - 6, window=4,
                            scaling=attention_modules(model)[0].scaling)


def _assert_reproduces_the_model(model, prompt, res) -> None:
    """``res`` decodes the model's own greedy tokens with its log-probabilities (1e-4)."""
    set_attention(model, "eager")  # the model's own rule, its own cache
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=N_NEW, do_sample=False,
                             pad_token_id=0, eos_token_id=None, min_new_tokens=N_NEW,
                             output_logits=True, return_dict_in_generate=True)
    ids = out.sequences[0, PROMPT_LEN:].tolist()
    assert res.generated_ids == ids
    logprobs = [float(torch.log_softmax(lg[0].double(), -1)[t])
                for lg, t in zip(out.logits, ids, strict=True)]
    np.testing.assert_allclose(res.logprobs, logprobs, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("arch", "score", "design"), [
    ("gemma3", "h2o", "poisson"),  # sliding + full, MQA; certified: the one-pass path
    ("gpt_oss", "snapkv", "topk"),  # sliding + full, sinks; uncertified: the eager path
    ("gemma2", "snapkv", "topk"),  # soft-cap
])
def test_full_budget_reproduces_the_models_logits(arch, score, design):
    model = tiny_model(arch, seed=3)
    prompt = _prompt()
    pre = _prefill(model, prompt)
    policy = make_policy(score, design, 1.0, score_params={"window": 4})
    res = decode_policy(model, pre, layer_plans(pre.traces, policy, seed=0), N_NEW, set(),
                        policy=policy, seed=0)
    _assert_reproduces_the_model(model, prompt, res)


def test_one_pass_folds_the_window_like_the_models_mask():
    """A 50 % Poisson budget on gemma3 (layer 0 sliding, window 8 < the prompt): the one-pass
    decode (window folded into its bias) and the SDPA path (the model's sliding mask) agree on
    tokens, log-probs and certificates."""
    model = tiny_model("gemma3", seed=3)
    pre = _prefill(model, _prompt())
    policy = make_policy("h2o", "poisson", 0.5, score_params={"window": 4})
    plans = layer_plans(pre.traces, policy, seed=1)
    one = decode_policy(model, pre, plans, N_NEW, set(), policy=policy, seed=1)
    two = decode_policy(model, pre, plans, N_NEW, set(), policy=policy, seed=1, one_pass=False)
    assert one.generated_ids == two.generated_ids
    np.testing.assert_allclose(one.logprobs, two.logprobs, rtol=0, atol=1e-4)
    for a, b in zip(one.certificates, two.certificates, strict=True):
        for layer in a:
            np.testing.assert_allclose(a[layer][0], b[layer][0], rtol=1e-3, atol=1e-6)
    # The window matters here: without it the one-pass output differs from the model's.
    assert pre.prompt_length > 8


def test_unimplemented_in_loop_variants_are_refused_before_decoding():
    model = tiny_model("gpt_oss", seed=3)
    pre = _prefill(model, _prompt())
    certified = make_policy("h2o", "poisson", 0.5, score_params={"window": 4})
    with pytest.raises(ValueError, match="certificates with attention sinks"):
        decode_policy(model, pre, layer_plans(pre.traces, certified, seed=0), N_NEW, set(),
                      policy=certified, seed=0)
    gemma2 = tiny_model("gemma2", seed=3)
    per_step = make_policy("perstep", "topk", 0.5, schedule="step",
                           score_params={"window": 4, "proxy": "exact"})
    with pytest.raises(ValueError, match="per-step designs on a model with soft-cap"):
        decode_policy(gemma2, _prefill(gemma2, _prompt()), {}, N_NEW, set(), policy=per_step,
                      seed=0)


def test_per_step_designs_draw_within_a_sliding_window():
    """gemma3 (layer 0 sliding, window 8 < the prompt): at full budget a per-step Poisson design
    reproduces the model's logits; at 50 % its one-pass decode (window folded into the bias)
    agrees with the SDPA path (the model's own sliding mask), and a sliding layer never attends
    more than its window."""
    model = tiny_model("gemma3", seed=3)
    prompt = _prompt()
    pre = _prefill(model, prompt)
    window = model.config.sliding_window
    assert pre.prompt_length > window
    full = make_policy("perstep", "poisson", 1.0, schedule="step",
                       score_params={"window": 4, "proxy": "exact"})
    res = decode_policy(model, pre, {}, N_NEW, set(), policy=full, seed=0)
    _assert_reproduces_the_model(model, prompt, res)

    model = tiny_model("gemma3", seed=3)
    pre = _prefill(model, prompt)
    half = make_policy("perstep", "poisson", 0.5, schedule="step",
                       score_params={"window": 4, "proxy": "exact"})
    one = decode_policy(model, pre, {}, N_NEW, set(), policy=half, seed=1)
    two = decode_policy(model, pre, {}, N_NEW, set(), policy=half, seed=1, one_pass=False)
    assert one.generated_ids == two.generated_ids
    np.testing.assert_allclose(one.logprobs, two.logprobs, rtol=0, atol=1e-4)
    assert one.certificates and len(one.certificates) == len(two.certificates)
    for a, b in zip(one.certificates, two.certificates, strict=True):
        for layer in a:
            np.testing.assert_allclose(a[layer][0], b[layer][0], rtol=1e-3, atol=1e-6)
    sliding = [i for i, kind in enumerate(model.config.layer_types) if kind == "sliding_attention"]
    assert sliding and one.step_kept
    full_layers = [i for i in range(len(model.config.layer_types)) if i not in sliding]
    for kept in one.step_kept:  # tokens of [0, t) attended per (layer, KV head)
        # (t - w, t] holds w - 1 earlier tokens; a full layer keeps half of all of [0, t)
        assert (kept[sliding] <= window - 1).all() and (kept[sliding] > 0).all()
    assert max(int(k[full_layers].max()) for k in one.step_kept) > window
