"""``tracesim capture``: record attention traces of a Hugging Face model on generated tasks.

This module must stay importable without torch (``tracesim --help`` works without it); the heavy
imports happen inside :func:`run`.
"""

from __future__ import annotations

import argparse
import sys

_TASKS = ("passkey", "multikey", "vartrack", "kvret")  # mirrors tracesim.capture.tasks.TASKS


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``capture`` subcommand."""
    p = subparsers.add_parser(
        "capture",
        help="record attention traces of a model on generated long-context tasks",
        description="Run generated RULER-style tasks, or your own prompts (--prompts), "
        "through a Hugging Face causal LM with the recording attention hook and write a trace "
        "store. Resumable: sequences already in the store are skipped. See docs/capture.md.",
        epilog="examples:\n  tracesim capture --model smollm2 --tasks passkey,vartrack --n 4 "
        "--length 512 --out traces/\n  tracesim capture --prompts my.jsonl --out traces/mine "
        "--layers 0-3 --heads 0",
    )
    p.add_argument("--model", default="smollm2",
                   help="a built-in model, 'smollm2' (default) or 'gemma3-270m', or a local "
                   "transformers checkpoint directory")
    p.add_argument("--tasks", default="passkey",
                   help=f"comma-separated task names from {', '.join(_TASKS)} (default passkey)")
    p.add_argument("--n", type=int, default=16, help="instances per task (default 16)")
    p.add_argument("--length", type=int, default=1024,
                   help="target prompt length in tokens (default 1024)")
    p.add_argument("--out", required=True, help="trace store directory (created or resumed)")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help="capture your own prompts instead of generated tasks: one JSON object "
                   "per line with id, prompt or messages, optional question, answer, grader "
                   "(exact|contains|regex), task, max_new_tokens (docs/capture.md); the whole "
                   "file is validated first (default: none)")
    p.add_argument("--layers", default=None, metavar="LIST",
                   help="model layers to store, e.g. '0,4,8-11' (default: all)")
    p.add_argument("--heads", default=None, metavar="LIST",
                   help="KV heads to store, e.g. '0-1'; each keeps its GQA group of query "
                   "heads (default: all)")
    p.add_argument("--no-chat-template", action="store_true",
                   help="tokenize the plain prompt text, without the tokenizer's chat template "
                   "(default: use the template if the tokenizer has one)")
    p.add_argument("--dtype", choices=("float16", "float32"), default="float16",
                   help="storage dtype of tensors (default float16; float32 for exact replay)")
    p.add_argument("--compute-dtype", choices=("auto", "float32", "bfloat16", "float16"),
                   default="auto", help="model dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="generation budget (default: each task's own)")
    p.add_argument("--window", type=int, default=32,
                   help="observation window length w for the context/question windows, in "
                   "tokens (default 32)")
    p.add_argument("--all-positions", action="store_true",
                   help="record Q and outputs at every position (large)")
    p.add_argument("--seed", type=int, default=0, help="run seed (default 0)")
    p.add_argument("--depth", type=float, default=None,
                   help="fixed needle depth in [0, 1] (default: drawn per instance)")
    p.add_argument("--no-o-proj", action="store_true",
                   help="do not store the o_proj weights (saves n_layers*hidden*hidden*4 bytes)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars (neither the capture's nor the weights' loading)")
    p.set_defaults(func=run)


def parse_indices(text: str | None, option: str) -> list[int] | None:
    """``"0,4,8-11"`` -> ``[0, 4, 8, 9, 10, 11]``; None stays None.

    Raises
    ------
    ValueError
        Naming ``option`` and the expected form.
    """
    from tracesim.counts import LAYER_INDEX, LAYERS

    if text is None:
        return None
    spans: list[tuple[int, int]] = []
    for part in text.split(","):
        a, sep, b = part.strip().partition("-")
        try:
            if len(a) > 8 or len(b) > 8:  # beyond every bound; int() of a huge string is slow
                raise ValueError
            lo = int(a)
            hi = int(b) if sep else lo
        except ValueError:
            raise ValueError(f"{option} {text[:60]!r}: expected comma-separated indices "
                             f"(at most {LAYER_INDEX.hi}) or ranges like '0,4,8-11'") from None
        if lo < 0 or hi < lo or hi > LAYER_INDEX.hi:
            raise ValueError(f"{option}: range {part.strip()!r} is empty, negative or beyond "
                             f"{LAYER_INDEX.hi}, expected indices in [0, {LAYER_INDEX.hi}]")
        spans.append((lo, hi))
    # counted before a range is expanded
    n = sum(hi - lo + 1 for lo, hi in spans)
    if n > LAYERS.hi:
        raise ValueError(f"{option}: selects {n} indices, expected at most {LAYERS.hi}")
    out = [i for lo, hi in spans for i in range(lo, hi + 1)]
    LAYERS.check_items(out, option, ValueError)
    return out


def _check_options(args: argparse.Namespace) -> None:
    """Every count of the command line in its bound (``tracesim.counts``), before anything
    loads."""
    from tracesim.capture.prompts import MAX_NEW_TOKENS

    from tracesim.counts import SEED_VALUE, Count
    from tracesim.outpaths import check_output

    check_output(args.out, [("prompts file", args.prompts)])
    Count("instances per task", 10_000).check(args.n, "--n")
    Count("tokens", 1 << 20).check(args.length, "--length")
    Count("tokens", 1 << 20).check(args.window, "--window")
    if args.max_new_tokens is not None:
        MAX_NEW_TOKENS.check(args.max_new_tokens, "--max-new-tokens")
    SEED_VALUE.check(args.seed, "--seed")
    args.layer_list = parse_indices(args.layers, "--layers")
    args.head_list = parse_indices(args.heads, "--heads")


def _tokenizer_and_context(model: str) -> tuple[object, int | None]:
    """The model's tokenizer and context length (``max_position_embeddings``) from its
    tokenizer and config files only: no weight is read, so a prompt that cannot fit is refused
    before the model loads."""
    from pathlib import Path

    from tracesim.capture import models
    from transformers import AutoConfig, AutoTokenizer

    if model in models.BUILTIN_MODELS:
        # the converted checkpoint if it exists; else SmolLM2's GGUF metadata (never its
        # tensors: converting reads the weights). Gemma 3's GGUF must first be assembled from
        # its chunk packages, so an unconverted gemma3-270m is converted once here.
        cached = models.converted_checkpoint(model)
        if cached is not None:
            where: dict = {"pretrained_model_name_or_path": cached}
        elif model == "smollm2":
            gguf = models.smollm2_gguf()
            where = {"pretrained_model_name_or_path": gguf.parent, "gguf_file": gguf.name}
        else:
            where = {"pretrained_model_name_or_path": models.builtin_checkpoint(model)}
    elif Path(model).is_dir():
        where = {"pretrained_model_name_or_path": Path(model)}
    else:
        raise ValueError(f"--model {model[:200]!r}: is neither a built-in model "
                         f"({', '.join(models.BUILTIN_MODELS)}) nor a local checkpoint "
                         "directory, expected one of the two")
    from tracesim.capture.variants import UnsupportedModel, check_supported

    try:
        config = AutoConfig.from_pretrained(**where, local_files_only=True,
                                            trust_remote_code=False)
        # an architecture or attention variant capture cannot trace is named before anything
        # else is read
        check_supported(config)
        tokenizer = AutoTokenizer.from_pretrained(**where, local_files_only=True,
                                                  trust_remote_code=False)
    except UnsupportedModel:
        raise
    except (OSError, ValueError, KeyError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise ValueError(f"--model {model[:200]}: cannot read its tokenizer and config "
                         f"({reason}), expected a transformers checkpoint") from None
    config = getattr(config, "text_config", None) or config
    context = getattr(config, "max_position_embeddings", None)
    return tokenizer, context if isinstance(context, int) and context > 0 else None


def _check_fit(args: argparse.Namespace) -> None:
    """Tokenize every prompt (or check ``--length``) against the model's context.

    Raises
    ------
    ValueError
        A :class:`~tracesim.capture.prompts.PromptError` naming the line and the field, or
        ``--length`` beyond the context.
    """
    from tracesim.capture.prompts import check_context, render_prompt

    tokenizer, context = _tokenizer_and_context(args.model)
    if context is None:  # a config without a context length: nothing to check against
        return
    budget = args.max_new_tokens or 32  # the runner's default
    if args.prompt_specs is None:
        if args.length + budget > context:
            raise ValueError(f"--length {args.length} + {budget} new tokens exceeds the "
                             f"model's context of {context} tokens, expected at most "
                             f"{context - budget}")
        return
    for spec in args.prompt_specs:
        rendered = render_prompt(tokenizer, spec, chat_template=not args.no_chat_template,
                                 max_new_tokens=budget)
        # what the runner generates: --max-new-tokens overrides the line's own budget
        new_tokens = args.max_new_tokens or spec.max_new_tokens or budget
        check_context(rendered, spec, f"{args.prompts}:{spec.line}", context, new_tokens)


def _refuse(message: object) -> int:
    print(f"tracesim capture: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Execute ``tracesim capture``; returns the exit code.

    Everything about the inputs is checked before the model's weights load (and before the
    store directory is created): option bounds, the whole prompts file, and every prompt's
    token count against the model's context (tokenizer and config only).
    """
    try:
        _check_options(args)
    except ValueError as exc:
        return _refuse(exc)
    args.prompt_specs = None
    if args.prompts is not None:
        from tracesim.capture.prompts import PromptError, load_prompts

        try:
            args.prompt_specs = load_prompts(args.prompts)
        except PromptError as exc:
            return _refuse(exc)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in _TASKS]
    if unknown or not tasks:
        return _refuse(f"--tasks: unknown task(s) {unknown}; expected some of "
                       f"{', '.join(_TASKS)}")
    if args.depth is not None and not 0.0 <= args.depth <= 1.0:
        return _refuse("--depth must lie in [0, 1]")
    try:
        _check_fit(args)
    except (ValueError, FileNotFoundError) as exc:
        return _refuse(exc)

    import torch
    from tracesim.capture.runner import accuracy_table

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    compute = None if args.compute_dtype == "auto" else args.compute_dtype
    try:
        summary = _run(args, tasks, device, compute)
    except (ValueError, FileNotFoundError) as exc:
        # Bad lengths, a store holding another model (StoreError), a missing checkpoint.
        return _refuse(exc)
    print(f"wrote {len(summary.written)} sequence(s), skipped {len(summary.skipped)} already "
          f"stored, into {args.out}")
    if summary.written:
        print("full-cache accuracy of the sequences written now:")
        print(accuracy_table(summary.correct))
    return 0


def _run(args: argparse.Namespace, tasks: list[str], device: str, compute: str | None):
    from tracesim.capture.runner import CaptureConfig, run_capture

    if args.quiet:  # transformers draws its own bar while it loads the weights
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    return run_capture(
        args.model,
        tasks,
        args.n,
        args.length,
        args.out,
        storage_dtype=args.dtype,
        device=device,
        compute_dtype=compute,
        seed=args.seed,
        depth=args.depth,
        config=CaptureConfig(
            window=args.window,
            all_positions=args.all_positions,
            max_new_tokens=args.max_new_tokens,
        ),
        store_o_proj=not args.no_o_proj,
        progress=not args.quiet,
        prompts=args.prompt_specs,
        layers=args.layer_list,
        kv_heads=args.head_list,
        chat_template=not args.no_chat_template,
    )
