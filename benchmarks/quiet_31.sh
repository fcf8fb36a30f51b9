#!/usr/bin/env bash
# Issue 31's table, every row that runs on a CPU, in one go: run it on a quiet machine.
#
# Each row's benchmark alternates its two sides (A, B, A, B, ...) and prints medians and the
# load average beside every round; this script prints the load before and after each row.
# Figures are quoted only when every printed load is at or below the core count and nothing
# else ran (docs/replay.md, "Where the time goes").
#
#   row 1  per-step / prefill replay time per row, 4k      bench_perstep.py (in one process)
#   row 2  per-step / SnapKV at 32k                        bench_long_context.py, one process
#          per side, alternated (A: snapkv:poisson, B: perstep:quant:4:poisson)
#   row 3  one configuration vs a dense torch replay, and  bench_replay_store.py --synth 1024
#          output space on / off on the same workload      (SnapKV/Poisson 25 %, 32 seeds,
#                                                          30 layers, 7 decode queries)
#   row 4  output space on / off over 54 policies          bench_replay.py --positions 1024
#
# Usage: benchmarks/quiet_31.sh [--quick] [--baseline DIR] [--python PY]
#   --quick         tiny sizes, one minute or so: a smoke test of the script, not a figure
#   --baseline DIR  also run every row in DIR (a checkout of the earlier version, e.g. made
#                   with `git worktree add DIR REV`), alternated with this tree row by row
#                   (baseline first); each benchmark imports the tracesim of its own tree
#   --python PY     interpreter (default: .venv/bin/python of this tree, else python3)
# Threads: NUMBA_NUM_THREADS and OMP_NUM_THREADS default to the machine's core count.
# Full run: estimated 5 minutes on 2 cores (10 with --baseline) from earlier per-row timings,
# not yet timed whole; --quick took 3.5 min at load 7-9 (10 min with --baseline at load 6-9).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QUICK=0
BASELINE=""
PY=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --quick) QUICK=1; shift ;;
        --baseline) BASELINE="$(cd "${2:?--baseline needs a directory}" && pwd)"; shift 2 ;;
        --python) PY="${2:?--python needs an interpreter}"; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
        *) echo "quiet_31.sh: unknown argument '$1' (expected --quick, --baseline DIR or" \
                "--python PY)" >&2; exit 2 ;;
    esac
done
if [[ -z "$PY" ]]; then
    if [[ -x "$HERE/.venv/bin/python" ]]; then PY="$HERE/.venv/bin/python"; else PY=python3; fi
fi
if [[ -n "$BASELINE" && ! -f "$BASELINE/benchmarks/bench_perstep.py" ]]; then
    echo "quiet_31.sh: --baseline $BASELINE has no benchmarks/bench_perstep.py" \
         "(expected a checkout of this repository)" >&2
    exit 2
fi
CORES="$(nproc)"
export NUMBA_NUM_THREADS="${NUMBA_NUM_THREADS:-$CORES}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$CORES}"

if [[ $QUICK -eq 1 ]]; then
    PERSTEP=(--positions 512 --decode 8 --seeds 4 --rounds 2)
    LONG=(--positions 2048 --decode 4 --seeds 2); LONG_ROUNDS=2
    STORE=(--synth 256 --decode 4 --seeds 4 --rounds 2)
    # no torch here: under load its 54-policy baseline alone took 10-60 s a round at P = 256
    REPLAY=(--positions 256 --torch-positions "" --seeds 4 --rounds 2)
else
    PERSTEP=(--positions 4096 --decode 64 --seeds 32 --rounds 5)
    # the smallest long layer that shows the ratio: 16 per-step decode steps, 8 seeds
    LONG=(--positions 32768 --decode 16 --seeds 8); LONG_ROUNDS=3
    STORE=(--synth 1024 --decode 7 --seeds 32 --rounds 5)
    REPLAY=(--positions 1024 --torch-positions 1024 --seeds 32 --rounds 3)
fi

load() { cut -d' ' -f1-3 /proc/loadavg; }
show() {  # one bench_long_context.py --json line: replay time, peak RSS, load
    echo "$1" | "$PY" -c 'import json, sys; d = json.load(sys.stdin); print("%.2f s, peak %.0f MiB, load %.2f" % (d["replay_s"], d["peak_rss_mb"], d["load"]))'
}

trees=("$HERE")
[[ -n "$BASELINE" ]] && trees=("$BASELINE" "$HERE")

echo "== issue 31 benchmarks: $(date -u +%FT%TZ), $CORES cores, NUMBA_NUM_THREADS=" \
     "$NUMBA_NUM_THREADS, OMP_NUM_THREADS=$OMP_NUM_THREADS, quick=$QUICK, python $PY"
for tree in "${trees[@]}"; do
    echo "   tree $tree: $(git -C "$tree" log -1 --format='%h %s' 2>/dev/null | cut -c1-90)"
done
echo "   load at start: $(load)"

row() {  # row TITLE SCRIPT ARGS...: run one benchmark in every tree, load before and after
    local title="$1" script="$2"; shift 2
    for tree in "${trees[@]}"; do
        echo
        echo "== $title [$tree]: python benchmarks/$script $*"
        echo "   load before: $(load)"
        (cd "$tree" && "$PY" "benchmarks/$script" "$@")
        echo "   load after: $(load)"
    done
}

long_row() {  # row 2: one process per side (peak RSS is per process), A, B, A, B, ...
    for tree in "${trees[@]}"; do
        echo
        echo "== row 2: per-step / SnapKV, long context [$tree]: python" \
             "benchmarks/bench_long_context.py ${LONG[*]} --json --policies {A, B}" \
             "($LONG_ROUNDS alternated rounds)"
        echo "   load before: $(load)"
        local a=() b=() r t
        # untimed: the first process after a change compiles and caches the kernels
        for spec in snapkv:poisson perstep:quant:4:poisson; do
            (cd "$tree" && "$PY" benchmarks/bench_long_context.py --positions 2048 --decode 4 \
                --seeds 2 --json --policies "$spec" > /dev/null)
        done
        for ((r = 1; r <= LONG_ROUNDS; r++)); do
            t=$(cd "$tree" && "$PY" benchmarks/bench_long_context.py "${LONG[@]}" --json \
                --policies snapkv:poisson | tail -n 1)
            a+=("$t")
            t=$(cd "$tree" && "$PY" benchmarks/bench_long_context.py "${LONG[@]}" --json \
                --policies perstep:quant:4:poisson | tail -n 1)
            b+=("$t")
            echo "   round $r: A snapkv:poisson $(show "${a[-1]}"); B perstep:quant:4:poisson" \
                 "$(show "${b[-1]}")"
        done
        printf '%s\n' "${a[@]}" "---" "${b[@]}" | "$PY" -c '
import json, statistics, sys
text = sys.stdin.read().split("---\n")
a = [json.loads(x)["replay_s"] for x in text[0].split("\n") if x.strip()]
b = [json.loads(x)["replay_s"] for x in text[1].split("\n") if x.strip()]
ratio = statistics.median(y / x for x, y in zip(a, b))
print(f"   per-step / SnapKV = {ratio:.2f}x (median of {len(a)} alternated rounds; medians "
      f"A {statistics.median(a):.2f} s, B {statistics.median(b):.2f} s)")'
        echo "   load after: $(load)"
    done
}

row "row 1: per-step / prefill per row" bench_perstep.py "${PERSTEP[@]}"
long_row
row "row 3: one configuration vs dense torch; output space on / off" bench_replay_store.py \
    "${STORE[@]}"
row "row 4: output space on / off, 54 policies (and numba vs torch)" bench_replay.py \
    "${REPLAY[@]}"
echo
echo "== done $(date -u +%FT%TZ); load at end: $(load)"
