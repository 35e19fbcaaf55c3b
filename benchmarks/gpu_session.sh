#!/usr/bin/env bash
# One GPU session: every gpu-marked test, then the benchmark; logs and results under $OUT.
#   OUT=/tmp/out bash benchmarks/gpu_session.sh [quick|full|ablation|tune-decode] [extra benchmark args...]
# ablation: the decode ablation (split-K, PDL, top-k sum fusion, base-only; T 1/8/32, L=4, R 16/64; a few
# minutes) -> $OUT/ablation.{json,md}; tune-decode: first re-tune the decode entries (T 1, 8) of both models in
# the package's configs JSON (split-K, BLOCK_N, PDL; a copy lands in $OUT), then the ablation;
# quick/full: the layer benchmark -> $OUT/bench.{json,md}.
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
# pytest-xdist (on the H200 image): 8 workers share the GPU; the Triton/Inductor compiles, not the GPU, bound the
# run (all GPU tests: 4.5 min with 8 workers on 16 cores, 2026-12-03, against > 10 min serially)
if python3 -c "import xdist" 2>/dev/null; then XDIST=(-n "${GPU_TEST_WORKERS:-8}" --dist load); else XDIST=(); fi
TORCHINDUCTOR_COMPILE_THREADS=2 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE "${XDIST[@]}" --durations=20 \
  2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
if [ "$MODE" = tune-decode ]; then
  for model in gpt-oss-20b qwen3-30b-a3b; do
    python3 -m moe_lora_compile tune --model $model --tokens 1 8 --ranks 16 --start shipped \
      --groups w13.SPLIT_K w13.BLOCK_N w13.SPLIT_K w2.SPLIT_K pdl 2>&1 | tee -a "$OUT/tune.log"
  done
  cp moe_lora_compile/configs/*.json "$OUT/"
fi
if [ "$MODE" = ablation ] || [ "$MODE" = tune-decode ]; then
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
