#!/usr/bin/env bash
# The pass GPU tests with Dynamo's recompile log (which guard failed), uncaptured, into $OUT/recompiles.log.
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-/tmp/moe_lora_out}; mkdir -p "$OUT"
TORCH_LOGS=recompiles timeout ${1:-100} python3 -m pytest -m gpu -q -s -p no:cacheprovider -p no:logging -rfE \
  tests/passes/test_passes_gpu.py -k "bf16 or demo" tests/ops/test_triton_kernels.py::test_gpu_lora_linear_bf16 > "$OUT/recompiles.log" 2>&1
grep -E "passed|failed|triggered by|^ *- |Recompiling|^E " "$OUT/recompiles.log" | cut -c1-400 | head -40
