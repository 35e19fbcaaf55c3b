#!/usr/bin/env bash
# One GPU call for the whole-model decode work: the GPU tests it touches, the dense LoRA linear benchmark, then the
# decode benchmark; logs and results under $OUT.
#   OUT=/tmp/out bash benchmarks/gpu_decode_session.sh [tests|lin|decode|all] [extra bench_decode args...]
set -uo pipefail
MODE=${1:-all}; shift || true
OUT=${OUT:-/tmp/moe_lora_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } 2>&1 | tee "$OUT/env.txt"
rc=0
if [ "$MODE" = tests ] || [ "$MODE" = all ]; then
  TORCH_LOGS=recompiles timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE -p no:logging \
    tests/passes/test_passes_gpu.py "tests/graphs/test_decode_graphs.py" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  rc=$(( rc || PIPESTATUS[0] ))
fi
if [ "$MODE" = lin ] || [ "$MODE" = all ]; then
  timeout 120 python3 benchmarks/bench_lora_linear.py --configs --json "$OUT/lin.json" --md "$OUT/lin.md" \
    > "$OUT/lin.log" 2>&1; rc=$(( rc || $? )); cat "$OUT/lin.md"
fi
if [ "$MODE" = decode ] || [ "$MODE" = all ]; then
  python3 benchmarks/bench_decode.py --json "$OUT/decode.json" --md "$OUT/decode.md" --png "$OUT/decode.png" "$@" \
    2>&1 | tee "$OUT/decode.log" | grep -v "^\s*$" | tail -60
  rc=$(( rc || PIPESTATUS[0] ))
fi
exit $rc
