#!/usr/bin/env bash
# One GPU session: the gpu-marked kernel and CUDA-graph tests, then the benchmark; logs and results under $OUT.
#   OUT=/tmp/out bash benchmarks/gpu_session.sh [quick|full|ablation] [extra benchmark args...]
# ablation: the decode ablation (PDL off/on, top-k sum fused/unfused, base-only; T 1/8/32, L=4, R 16/64; a few
# minutes) -> $OUT/ablation.{json,md}; quick/full: the layer benchmark -> $OUT/bench.{json,md}.
set -uo pipefail
MODE=${1:-full}; shift || true
OUT=${OUT:-/tmp/moe_lora_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import torch; from moe_lora_compile.ops.triton.pdl import pdl_supported, triton_has_pdl; \
print('triton_has_pdl', triton_has_pdl(), 'pdl_supported', pdl_supported(torch.device('cuda')))"
} 2>&1 | tee "$OUT/env.txt"
python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/ops/test_triton_kernels.py tests/ops/test_cuda_graphs.py \
  2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
if [ "$MODE" = ablation ]; then
  python3 benchmarks/bench_fused_moe_lora.py --decode-ablation "$@" --json "$OUT/ablation.json" \
    --md "$OUT/ablation.md" 2>&1 | tee "$OUT/ablation.log"
  bench_rc=${PIPESTATUS[0]}
else
  if [ "$MODE" = quick ]; then BENCH_ARGS=(--quick); else BENCH_ARGS=(); fi
  python3 benchmarks/bench_fused_moe_lora.py "${BENCH_ARGS[@]}" "$@" --json "$OUT/bench.json" --md "$OUT/bench.md" \
    2>&1 | tee "$OUT/bench.log"
  bench_rc=${PIPESTATUS[0]}
fi
echo "tests rc=$tests_rc bench rc=$bench_rc" | tee -a "$OUT/env.txt"
exit $(( tests_rc != 0 || bench_rc != 0 ))
