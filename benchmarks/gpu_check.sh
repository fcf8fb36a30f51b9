#!/usr/bin/env bash
# Prepared GPU check (docs/gpu.md): capture SmolLM2 on CUDA (bf16 compute, fp16 store) and check
# the stored outputs against a float64 recomputation; then per-decode-step cost of top-k,
# Poisson + offset and Poisson + offset + one-pass certificate at 32k context on a Llama-shaped
# model; then one decode attention call with and without the certificate.
#
# Usage: benchmarks/gpu_check.sh [--dry] [OUT_DIR]     (default OUT_DIR: results/gpu_check)
#   --dry   run the same Python on the CPU with a tiny model and short contexts (seconds);
#           checks the code path without a GPU, its figures mean nothing.
# Environment: PYTHON (default: python).  Exit status: 0 ok, 1 a check failed, 2 usage,
# 3 no CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
DRY=()
if [[ "${1:-}" == "--dry" ]]; then DRY=(--dry); shift; fi
if [[ $# -gt 1 || "${1:-}" == -* ]]; then
    echo "usage: benchmarks/gpu_check.sh [--dry] [OUT_DIR]" >&2
    exit 2
fi
OUT="${1:-results/gpu_check}"
mkdir -p "$OUT"
if [[ ${#DRY[@]} -eq 0 ]]; then
    if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"; then
        echo "gpu_check: no CUDA device (use --dry for the CPU dry run)" >&2
        exit 3
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
fi
status=0
echo "== capture SmolLM2 (bf16 compute, fp16 store) and float64 recomputation"
"$PY" benchmarks/gpu_check.py capture "${DRY[@]}" --out "$OUT" || status=1
echo "== per-decode-step cost, Llama-shaped, 32k context"
"$PY" benchmarks/gpu_check.py steps "${DRY[@]}" --out "$OUT" || status=1
echo "== one decode attention call: certificate vs attention"
if [[ ${#DRY[@]} -eq 0 ]]; then
    "$PY" benchmarks/bench_serving_certificate.py --device cuda --rounds 5 --calls 20 \
        | tee "$OUT/serving_certificate.txt" || status=1
else
    "$PY" benchmarks/bench_serving_certificate.py --device cpu --context 512 --heads 4 \
        --kv-heads 2 --head-dim 16 --rounds 2 --calls 1 | tee "$OUT/serving_certificate.txt" \
        || status=1
fi
echo "gpu_check: results in $OUT (status $status)"
exit $status
