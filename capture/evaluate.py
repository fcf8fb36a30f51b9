"""Full-cache task accuracy without recording (how the accuracy table in docs/capture.md is made).

Usage::

    python -m tracesim.capture.evaluate --model smollm2 --tasks passkey,multikey,vartrack,kvret \
        --lengths 512,1024 --n 8 --seed 0
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from tracesim.capture.generate import greedy_generate
from tracesim.capture.models import LoadedModel, load_model
from tracesim.capture.runner import eos_token_ids
from tracesim.capture.tasks import TASKS, build_prompt, grade, instance_seed


def evaluate(
    loaded: LoadedModel,
    tasks: Sequence[str],
    lengths: Sequence[int],
    n: int,
    seed: int = 0,
    verbose: bool = False,
) -> dict[tuple[str, int], list[bool]]:
    """Greedy full-cache correctness per ``(task, length)``, on the instances a capture uses."""
    eos = eos_token_ids(loaded)
    results: dict[tuple[str, int], list[bool]] = {}
    for length in lengths:
        for task in tasks:
            flags = results.setdefault((task, length), [])
            for i in range(n):
                iseed = instance_seed(task, length, seed, i)
                prompt = build_prompt(loaded.tokenizer, task, length, iseed)
                gen = greedy_generate(loaded.model, prompt.token_ids, prompt.max_new_tokens, eos)
                ids = gen.generated_ids[:-1] if gen.stopped_on_eos else gen.generated_ids
                answer = loaded.tokenizer.decode(ids, skip_special_tokens=True)
                flags.append(grade(task, answer, prompt.gold))
                if verbose:
                    print(f"{task} L={length} i={i} gold={prompt.gold!r} answer={answer!r} "
                          f"ok={flags[-1]}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    """Print a markdown accuracy table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--lengths", default="512,1024")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    loaded = load_model(args.model, args.device, attn_implementation="sdpa")
    tasks = args.tasks.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    t0 = time.perf_counter()
    res = evaluate(loaded, tasks, lengths, args.n, args.seed, args.verbose)
    print(f"| task | {' | '.join(f'{length} tokens' for length in lengths)} |")
    print("|---|" + "---|" * len(lengths))
    for task in tasks:
        cells = [f"{sum(res[task, L])}/{len(res[task, L])}" for L in lengths]
        print(f"| {task} | {' | '.join(cells)} |")
    print(f"({time.perf_counter() - t0:.0f} s, model {loaded.model_id}, seed {args.seed})")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
