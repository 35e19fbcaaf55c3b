#!/usr/bin/env bash
# One GPU lease as three device calls of < 10 minutes each (every step has its own time limit, so a call always
# ends with its results packed): results under $OUT/<call>.tgz plus the markdown tables beside it.
#   OUT=/tmp/out bash benchmarks/gpu_lease.sh tests     # all gpu-marked tests (xdist, -v: a test's outcome is logged
#                                                       # as it ends, so a kill keeps the names), then micro-benchmarks
#   OUT=/tmp/out bash benchmarks/gpu_lease.sh serving   # benchmarks/bench_serving.py, GPT-OSS-20B geometry
#   OUT=/tmp/out bash benchmarks/gpu_lease.sh decode    # bench_decode GPT-OSS-20B: ours + HF eager/PEFT at batch
#                                                       # 1/8/32/64, then the chat-shaped run
#   OUT=/tmp/out bash benchmarks/gpu_lease.sh decode2   # bench_decode Qwen3-30B-A3B (batch 1/8), GPT-OSS's
#                                                       # hf_compiled in a second process (--gpu-lock)
#   OUT=/tmp/out bash benchmarks/gpu_lease.sh layer     # the MoE layer's grids: mixed ranks, MXFP4, the bf16 grid
#   OUT=/tmp/out bash benchmarks/gpu_lease.sh decode_ab # ours_none / ours_lora of GPT-OSS-20B once per variant of
#                                                       # the environment (AB_VARIANTS, ';'-separated), one process each
#   OUT=/tmp/out bash benchmarks/gpu_lease.sh base      # issue 16: vLLM's own base kernel beside ours
#                                                       # (bench_vllm_base.py; carry .whl/vllm_src), before and after
#                                                       # tuning our bf16 path at T 512 / 2048 (TUNE_TOKENS)
set -uo pipefail
CALL=${1:?tests|serving|decode|decode2|layer|decode_ab|base}
OUT=${OUT:-/tmp/moe_lora_out}
W="$OUT/$CALL"; export W
mkdir -p "$W"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
START=$(date +%s)
left() { echo $(( ${LIMIT:-570} - ($(date +%s) - START) )); }
step() {  # step NAME SECONDS CMD...: run with a time limit (capped by what the call has left), log to $W/NAME.log
  local name=$1 secs=$2; shift 2
  local cap; cap=$(left); [ "$cap" -lt "$secs" ] && secs=$cap
  if [ "$secs" -le 5 ]; then echo "SKIP $name (call time spent)" | tee -a "$W/steps.txt"; return; fi
  local t0; t0=$(date +%s)
  timeout --signal=INT --kill-after=10 "$secs" "$@" > "$W/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$W/steps.txt"
}
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'peft', peft.__version__)"; git log --oneline -1 2>/dev/null
  # the device's copy of .git can lag its working tree (2026-12-05: it named 79f0b4c for a later tree): name the
  # files too (compare with the same line run here: git ls-files -z moe_lora_compile | xargs -0 cat | sha1sum)
  echo "moe_lora_compile files sha1 $(git ls-files -z moe_lora_compile 2>/dev/null | xargs -0 cat | sha1sum | cut -c1-12)"; } \
  > "$W/env.txt" 2>&1
cat "$W/env.txt"

render_decode() {
  python3 benchmarks/bench_decode.py --render "$W"/decode_*.json --md "$W/decode.md" --png "$W/decode.png" \
    > /dev/null 2>&1
  grep -h "tok/s\|compile" "$W"/decode_*.log | tail -40
}

case $CALL in
tests)
  # workers: 8 by default. On the H100's 80 GB, 14 ran out of memory (2026-12-05) and 10 twice (12-07); 8 ran the
  # whole suite in two calls with none (12-07: 93 s for four ops files, 301 s for the rest, split with TEST_PATHS)
  DEF_WORKERS=8
  if python3 -c "import xdist" 2>/dev/null; then XDIST=(-n "${GPU_TEST_WORKERS:-$DEF_WORKERS}" --dist load); else XDIST=(); fi
  # TEST_PATHS: the paths (or node ids) to run (default: all of tests/); an 80 GB card runs the suite in two calls
  # shellcheck disable=SC2086  # TEST_PATHS is a list of words
  step gpu_tests "${TESTS_LIMIT:-390}" env TORCHINDUCTOR_COMPILE_THREADS="${COMPILE_THREADS:-2}" python3 -m pytest -m gpu -v -p no:cacheprovider -rfE \
    "${XDIST[@]}" --durations=15 ${TEST_PATHS:-tests}
  tail -25 "$W/gpu_tests.log"
  # RERUN_FAILED=N: the failed / erroring tests again on N workers in what the call has left (many workers can run
  # an 80 GB card out of memory: such a failure is about the run, the rerun says whether it is about the code)
  FAILED_IDS=$(grep -oE "^(FAILED|ERROR) tests/[^ ]+" "$W/gpu_tests.log" | awk '{print $2}' | sort -u)
  if [ -n "${RERUN_FAILED:-}" ] && [ -n "$FAILED_IDS" ]; then
    echo "rerun of $(echo "$FAILED_IDS" | wc -l) failed tests on ${RERUN_FAILED} workers" | tee -a "$W/steps.txt"
    # shellcheck disable=SC2086  # one node id per word
    step gpu_rerun "$(( $(left) - 20 ))" python3 -m pytest -m gpu -v -p no:cacheprovider -rfE -n "$RERUN_FAILED" \
      $FAILED_IDS
    tail -15 "$W/gpu_rerun.log"
  fi
  # micro-benchmarks after the tests, chosen by MICRO (default: all of them but tune_mxfp4 and tunecheck, in this order)
  for m in ${MICRO:-attn ablation mxfp4 ranks router tune}; do case $m in
    attn) step attn 60 python3 benchmarks/bench_attention.py --batches 1 8 64 --md "$W/attn.md" ;;
    ablation) step ablation 60 python3 benchmarks/bench_fused_moe_lora.py --decode-ablation --models gpt-oss-20b \
      --tokens 8 32 64 --ranks 32 --rep-ms 25 --json "$W/ablation.json" --md "$W/ablation.md" ;;
    mxfp4) step mxfp4 60 python3 benchmarks/bench_fused_moe_lora.py --mxfp4 --quick --json "$W/mxfp4.json" \
      --md "$W/mxfp4.md" ;;
    ranks) step ranks 60 python3 benchmarks/bench_fused_moe_lora.py --mixed-ranks --models gpt-oss-20b \
      --json "$W/ranks.json" --md "$W/ranks.md" ;;
    router) step router 40 python3 benchmarks/bench_router.py ;;
    # MXFP4 tuned (no shipped entry yet: the heuristic ran 29x its floor at T=1 on 2026-12-03), then the quick grid
    # again on the tuned entries (the tuner merges into the package's table of this GPU; a copy comes back)
    tune_mxfp4) step tune_mxfp4 150 python3 -m moe_lora_compile tune --model gpt-oss-20b --mxfp4 --tokens 1 8 32 \
      --ranks 16 --budget-s 110
      cp moe_lora_compile/configs/NVIDIA_*.json "$W/" 2>/dev/null
      step mxfp4_tuned 60 python3 benchmarks/bench_fused_moe_lora.py --mxfp4 --quick --json "$W/mxfp4_tuned.json" \
        --md "$W/mxfp4_tuned.md" ;;
    # the three tuners briefly, to see their float32 reference check on real shapes (1e265bb: a candidate more than
    # configs.MAX_REL_ERROR off is rejected; bf16 output rounding is ~0.3 %, so a rejection here names a wrong config
    # or a wrong check): their tables merge into the package's copy on the device only, none comes back
    tunecheck) step tunecheck_moe 70 python3 -m moe_lora_compile tune --model gpt-oss-20b --tokens 1 --ranks 16 \
      --budget-s 25
      step tunecheck_mxfp4 60 python3 -m moe_lora_compile tune --model gpt-oss-20b --mxfp4 --tokens 1 --ranks 16 \
        --budget-s 20
      step tunecheck_linear 60 python3 -m moe_lora_compile.ops.triton.tune_linear --models gpt-oss-20b \
        --budget-s 20 --out "$W/linear_check.json"
      grep -c "rejected" "$W"/tunecheck_*.log | tee -a "$W/steps.txt" ;;
    # the dense LoRA tuner (GPT-OSS-20B shapes; merges into the package's table, a copy comes back)
    tune) step tune_linear 130 python3 -m moe_lora_compile.ops.triton.tune_linear --models gpt-oss-20b \
      --budget-s 95 --out "$W/NVIDIA_H200_linear.json"
      grep -h "best\|^|" "$W/tune_linear.log" | tail -12 ;;
  esac; done
  [ -n "${EXTRA_TESTS_CALL:-}" ] && step extra 240 bash -c "$EXTRA_TESTS_CALL"
  ;;
serving)
  # all three rates did not fit one call on 2026-12-04 (engine ready in 184 s, 12 runs' arrivals 267 s): split it
  # with SERVING_ARGS="--rates LOW NEAR OVER --loads over ..." and merge with bench_serving.py --render
  step serving 560 python3 benchmarks/bench_serving.py --model gpt-oss-20b ${SERVING_ARGS:-} \
    --json "$W/serving.json" --md "$W/serving.md" --png "$W/serving.png"
  tail -30 "$W/serving.log"
  [ -n "${EXTRA_SERVING_CALL:-}" ] && step extra 200 bash -c "$EXTRA_SERVING_CALL"
  ;;
decode)
  # ours (4 compiled buckets, ~50 s each on the H200) + HF eager / PEFT, then the chat-shaped run: ~450 s alone. The
  # 2026-12-04 lease ran hf_compiled beside it in a second process: both compiles slowed and this step hit its limit
  step decode_main 380 python3 benchmarks/bench_decode.py --models gpt-oss-20b --batches 1 8 32 64 --prompt 512 \
    --new 128 --columns hf_eager hf_peft ours_none ours_lora --hf-new 16 --fuse-qkv --eager-prefill \
    --profile 1 8 ${DECODE_ARGS:-} --json "$W/decode_main.json"
  step decode_chat 170 python3 benchmarks/bench_decode.py --models gpt-oss-20b --batches 1 --prompt 1600 --new 600 \
    --columns hf_eager ours_none ours_lora --hf-new 16 --fuse-qkv --eager-prefill --profile 1 \
    ${DECODE_ARGS:-} --json "$W/decode_chat.json"
  render_decode
  ;;
decode2)
  # the second geometry (48 layers: compiles take ~2x) and GPT-OSS's hf_compiled (198 + 126 s of compiles on
  # 2026-12-04) in a second process; the timed sections of both hold $LOCK. On a card under 100 GB the two models
  # (~61 + ~40 GB) do not fit side by side (out of memory on the H100, 2026-12-05 and 12-07): one after the other,
  # Qwen3 first (~200 s on the H100 with its profile, hf_compiled ~230 s)
  LOCK=/tmp/gpu_timing.lock
  MEM_MB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  HFC_CMD=(python3 benchmarks/bench_decode.py --models gpt-oss-20b --batches 1 8 --prompt 512 --new 128
    --columns hf_compiled --hf-new 32 --gpu-lock "$LOCK" --json "$W/decode_hfc.json")
  if [ -n "$MEM_MB" ] && [ "$MEM_MB" -lt 100000 ]; then SIDE_BY_SIDE=0 QWEN_DEF=280; else SIDE_BY_SIDE=1 QWEN_DEF=540; fi
  if [ "$SIDE_BY_SIDE" = 1 ]; then
    timeout --signal=INT 540 "${HFC_CMD[@]}" > "$W/decode_hfc.log" 2>&1 &
    HFC=$!
  fi
  # shellcheck disable=SC2086  # DECODE_ARGS is a list of words
  step decode_qwen "${QWEN_LIMIT:-$QWEN_DEF}" python3 benchmarks/bench_decode.py --models qwen3-30b-a3b --batches 1 8 \
    --prompt 512 --new 128 --columns hf_eager ours_none ours_lora --hf-new 16 --fuse-qkv --eager-prefill \
    --profile 1 --gpu-lock "$LOCK" ${DECODE_ARGS:-} --json "$W/decode_qwen.json"
  if [ "$SIDE_BY_SIDE" = 1 ]; then
    wait $HFC; echo "decode_hfc rc=$?" | tee -a "$W/steps.txt"
  else
    step decode_hfc 300 "${HFC_CMD[@]}"
  fi
  render_decode
  ;;
layer)
  # the layer benchmark's grids (issue 16): mixed ranks per model, the MXFP4 grid (GPT-OSS-20B, T 1-512, L 1/4/16,
  # R 16/64), then the full bf16 grid with every column (bench_fused_moe_lora.py's defaults)
  step ranks "${RANKS_LIMIT:-110}" python3 benchmarks/bench_fused_moe_lora.py --mixed-ranks --json "$W/ranks.json" \
    --md "$W/ranks.md"
  step mxfp4_grid "${MXFP4_LIMIT:-200}" python3 benchmarks/bench_fused_moe_lora.py --mxfp4 --json "$W/mxfp4_grid.json" \
    --md "$W/mxfp4_grid.md"
  step grid "${GRID_LIMIT:-320}" python3 benchmarks/bench_fused_moe_lora.py ${GRID_ARGS:-} --json "$W/grid.json" \
    --md "$W/grid.md"
  tail -3 "$W"/ranks.log "$W"/mxfp4_grid.log "$W"/grid.log
  ;;
decode_ab)
  # an A/B of environment switches on the whole step, each variant in its own process (the hot-path switches are
  # read once); default: the heuristic configs against the tables this GPU reads (MOE_LORA_CONFIGS). A config
  # coordinate: a variant table (benchmarks/variant_tables.py), named in a variant (MOE_LORA_CONFIGS=S4);
  # AB_TABLES="S4:shrink.SPLIT_K=4 BOTH:spread_expand=true,w2_sum_in_loop=true" writes them first (at T 1-8)
  for spec in ${AB_TABLES:-}; do
    sets=${spec#*:}
    # shellcheck disable=SC2086  # the comma-separated settings become --set's words
    python3 benchmarks/variant_tables.py --name "${spec%%:*}" --set ${sets//,/ } 2>&1 | tee -a "$W/steps.txt"
  done
  IFS=';' read -ra VARIANTS <<< "${AB_VARIANTS:-MOE_LORA_CONFIGS=0;MOE_LORA_CONFIGS=auto}"
  i=0
  for v in "${VARIANTS[@]}"; do
    echo "ab_$i: $v" | tee -a "$W/steps.txt"
    # shellcheck disable=SC2086  # a variant is a list of NAME=VALUE words
    step "ab_$i" "${AB_LIMIT:-170}" env $v python3 benchmarks/bench_decode.py --models "${AB_MODEL:-gpt-oss-20b}" \
      --batches ${AB_BATCHES:-1 8} --prompt 512 --new 128 --columns ours_none ours_lora --fuse-qkv --eager-prefill \
      --no-profile ${DECODE_ARGS:-} --json "$W/ab_$i.json"
    grep -h "tok/s" "$W/ab_$i.log" | tail -6
    i=$((i + 1))
  done
  ;;
base)
  # vLLM's fused_moe_kernel (its source from the carried wheel, unchanged) against our layer without LoRA; on the
  # H100 (2026-12-07) ours was 1.37-1.48x vLLM at T=2048 on the heuristic's 64-wide, 4-warp tiles, with no tuned
  # bf16 entry there. The tuner merges into the package's table of this GPU (a copy comes back), then the same
  # comparison runs again on the tuned entries.
  VSRC=${VLLM_SRC:-.whl/vllm_src}
  step vllm_base_before "${BASE_LIMIT:-100}" python3 benchmarks/bench_vllm_base.py --vllm-src "$VSRC" \
    --json "$W/vllm_base_before.json" --md "$W/vllm_base_before.md"
  for model in ${TUNE_MODELS:-qwen3-30b-a3b gpt-oss-20b}; do
    # shellcheck disable=SC2086  # TUNE_TOKENS is a list of words
    step "tune_$model" "${TUNE_LIMIT:-170}" python3 -m moe_lora_compile tune --model "$model" \
      --tokens ${TUNE_TOKENS:-512 2048} --ranks 16 --budget-s "${TUNE_BUDGET:-140}"
  done
  cp moe_lora_compile/configs/NVIDIA_*.json "$W/" 2>/dev/null
  step vllm_base_after "${BASE_LIMIT:-100}" python3 benchmarks/bench_vllm_base.py --vllm-src "$VSRC" \
    --json "$W/vllm_base_after.json" --md "$W/vllm_base_after.md"
  tail -20 "$W"/vllm_base_before.md "$W"/vllm_base_after.md 2>/dev/null
  ;;
esac
cp "$W"/*.md "$W"/*.png "$OUT/" 2>/dev/null
tar czf "$OUT/$CALL.tgz" -C "$W" .
rm -rf "$W"
ls -la "$OUT"
