"""The recorder on the default model, SmolLM2-135M-Instruct, with one short prompt."""

from __future__ import annotations

import pytest
from tracesim.capture.attention import CaptureState, recording
from tracesim.capture.generate import greedy_generate
from tracesim.capture.models import SMOLLM2_ID, load_model, model_info, set_attention
from tracesim.capture.runner import eos_token_ids, query_roles
from tracesim.capture.tasks import build_prompt, grade

from tests.test_capture_attention import check_against_hf

pytestmark = pytest.mark.capture


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


def test_smollm2_metadata(smollm2):
    assert smollm2.model_id == SMOLLM2_ID
    info = model_info(smollm2.model)
    assert info == dict(architecture="LlamaForCausalLM", n_layers=30, n_heads=9, n_kv_heads=3,
                        head_dim=64, hidden_size=576, scaling=0.125)


def test_smollm2_short_prompt_matches_eager(smollm2):
    model, tok = smollm2.model, smollm2.tokenizer
    prompt = build_prompt(tok, "passkey", 160, seed=11, depth=0.5)
    plen = prompt.prompt_length
    positions, _ = query_roles(plen, prompt.question_start, plen, 16, False)
    state = CaptureState(plen, positions, record_from=plen)
    with recording(model, state):
        gen = greedy_generate(model, prompt.token_ids, 8, eos_token_ids(smollm2), state=state)
    layers = state.finalize()
    answer = tok.decode(gen.generated_ids, skip_special_tokens=True)
    assert grade("passkey", answer, prompt.gold), answer
    try:
        set_attention(model, "sdpa")
        plain = greedy_generate(model, prompt.token_ids, 8, eos_token_ids(smollm2))
        assert plain.generated_ids == gen.generated_ids
        # 30 fp32 layers: end-to-end drift between SDPA and eager reaches ~3e-6 relative.
        check_against_hf(model, prompt.token_ids, gen, layers, len(gen.generated_ids), 1e-5)
    finally:
        set_attention(model, "tracesim_capture")
