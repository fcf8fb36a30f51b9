"""``tracesim capture``: record attention traces of a Hugging Face model on generated tasks.

This module must stay importable without torch (``tracesim --help`` works without it); the heavy
imports happen inside :func:`run`.
"""

from __future__ import annotations

import argparse

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
                   help="'smollm2' (default) or a local transformers checkpoint directory")
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


def run(args: argparse.Namespace) -> int:
    """Execute ``tracesim capture``; returns the exit code."""
    try:
        from tracesim.outpaths import check_output

        check_output(args.out, [("prompts file", args.prompts)])
        args.layer_list = parse_indices(args.layers, "--layers")
        args.head_list = parse_indices(args.heads, "--heads")
    except ValueError as exc:
        print(f"tracesim capture: {exc}")
        return 2
    args.prompt_specs = None
    if args.prompts is not None:
        from tracesim.capture.prompts import PromptError, load_prompts

        try:
            args.prompt_specs = load_prompts(args.prompts)
        except PromptError as exc:
            print(f"tracesim capture: {exc}")
            return 2
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in _TASKS]
    if unknown or not tasks:
        print(f"tracesim capture: unknown task(s) {unknown}; expected some of {', '.join(_TASKS)}")
        return 2
    if args.n < 1 or args.length < 1 or args.window < 1:
        print("tracesim capture: --n, --length and --window must be positive")
        return 2
    if args.depth is not None and not 0.0 <= args.depth <= 1.0:
        print("tracesim capture: --depth must lie in [0, 1]")
        return 2

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
        print(f"tracesim capture: {exc}")
        return 2
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
