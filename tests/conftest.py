"""Fixtures shared by several test modules."""

import pytest


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    """(store path, LoadedModel) of two 160-token passkey sequences captured from a tiny Llama
    (torch is imported here, so test modules without capture tests never need it)."""
    from tracesim.capture.models import LoadedModel, load_tokenizer, tiny_model
    from tracesim.capture.runner import CaptureConfig, run_capture

    tok = load_tokenizer()
    model = tiny_model("llama", seed=3, vocab_size=len(tok))
    loaded = LoadedModel(model, tok, "tiny-llama")
    out = tmp_path_factory.mktemp("evict") / "traces"
    run_capture(loaded, ["passkey"], n=2, length=160, out=out, storage_dtype="float32",
                config=CaptureConfig(window=8, max_new_tokens=6), progress=False)
    return out, loaded
