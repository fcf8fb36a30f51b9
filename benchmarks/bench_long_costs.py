"""Memory and transfer costs of per-step and prefill designs on one long synthetic layer.

Builds the SmolLM2-shaped layer of ``bench_long_context.py`` (9 query heads, 3 KV heads,
d = 64, ``--positions`` positions, ``--decode`` decode queries at the consecutive positions
``P - decode .. P - 1``), replays every policy of ``--policies`` (the spellings of
``bench_long_context.py``, budget 25 %) on it, one policy per replay so that the process holds
one policy's tables at a time, with ``--seeds`` seeds and the output-space certificate off (no
cost column reads it). The result rows (:func:`tracesim.replay.results.layer_batch`, seed means)
then go through :func:`tracesim.analysis.perstep.perstep_table` and
:func:`tracesim.analysis.perstep_costs.cost_columns`, as ``python -m tracesim.analysis.perstep``
does with a
replay's output: HBM per layer, rows read per step, bytes over the link (rows or partial sums)
and the modelled transfer time per layer and step, summed over the 3 KV heads, from the tiers
memory model's defaults (``docs/perstep.md``, "Costs").

The costs depend on the mean kept tokens per step (``kept_tokens``) and the positions, not on
the estimates, so a few seeds and decode steps give them; every step's kept set is still a real
draw of the design.

Usage: ``python benchmarks/bench_long_costs.py [--positions 131072] [--decode 16] [--seeds 2]
[--policies ...] [--json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.bench_long_context import long_layer, parse_policies  # noqa: E402
from benchmarks.protocol import peak_rss_mb  # noqa: E402

#: The per-step proxies of the 1k cost table (``docs/perstep.md``) and SnapKV's prefill design.
DEFAULT_POLICIES = ("perstep:exact:poisson,perstep:quant:4:poisson,perstep:quant:2:poisson,"
                    "perstep:pages:16:poisson,perstep:simhash:10,150:poisson,snapkv:poisson")
#: Columns printed (and returned), in order.
COLUMNS = ("score", "proxy", "design", "schedule", "kept", "hbm_kib", "read_rows", "link_kib",
           "link_kib_partial", "step_us", "step_us_partial")


def cost_table(positions: int, decode: int, seeds: int, policies: str,
               head_dim: int = 64):
    """Replay ``policies`` on the synthetic layer and return the cost table.

    Returns
    -------
    table : pandas.DataFrame
        One row per policy: :data:`COLUMNS` (``kept`` is the mean kept tokens per KV head and
        step, before the step's own token; the cost columns are per layer and decode step,
        summed over the KV heads, in KiB and microseconds).
    replay_s : float
        Wall time of the replays, seconds.
    """
    import pandas as pd
    from tracesim.analysis.perstep import perstep_table
    from tracesim.analysis.perstep_costs import cost_columns

    from tracesim.replay import ReplayOptions, replay_layer
    from tracesim.replay.results import layer_batch

    opts = ReplayOptions(output_space=False)
    pols = parse_policies(policies)
    trace = long_layer(positions, n_decode=decode)
    frames = []
    t = time.perf_counter()
    for pol in pols:  # one policy at a time: its inclusion tables are freed before the next
        res = replay_layer(trace, [pol], np.arange(seeds), n_layers=30, options=opts)
        frames.append(layer_batch(res).to_pandas())
        del res
    wall = time.perf_counter() - t
    df = pd.concat(frames, ignore_index=True)
    table = cost_columns(perstep_table(df, head_dim), df, head_dim)
    return table[list(COLUMNS)], wall


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=131072)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--policies", default=DEFAULT_POLICIES,
                    help="SCORE:DESIGN or perstep:PROXY:DESIGN, comma-separated "
                         "(bench_long_context.py)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    table, wall = cost_table(args.positions, args.decode, args.seeds, args.policies)
    out = {"positions": args.positions, "decode": args.decode, "seeds": args.seeds,
           "replay_s": wall, "peak_rss_mb": peak_rss_mb(), "load": os.getloadavg()[0],
           "rows": table.to_dict(orient="records")}
    if args.json:
        print(json.dumps(out))
    else:
        import pandas as pd

        whole = {c: "{:.0f}".format for c in ("kept", "hbm_kib", "read_rows", "link_kib",
                                                "step_us")}
        tenths = {c: "{:.1f}".format for c in ("link_kib_partial", "step_us_partial")}
        with pd.option_context("display.width", 200, "display.max_columns", 20):
            print(table.to_string(index=False, formatters={**whole, **tenths}))
        print(f"P = {args.positions}, {args.decode} decode steps, {args.seeds} seeds: replays "
              f"{wall:.1f} s; peak RSS {out['peak_rss_mb']:.0f} MiB; load {out['load']:.2f}")
    return out


if __name__ == "__main__":
    main()
