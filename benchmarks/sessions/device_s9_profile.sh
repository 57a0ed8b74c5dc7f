#!/usr/bin/env bash
# Session 9, call 3: is the one GEMM test failure of call 2 (n192, config (128, 64, 256, 8, 3, True), per-row
# NVFP4, Triton-ops dequant) repeatable; then one profiled training step per variant (where plain QAT's +15% over
# BF16 goes at the Qwen3-30B-A3B layer shape).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
for i in 1 2 3; do
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_triton.py \
      -k "n192 and 256 and nvfp4-True" 2>&1 | grep -E "passed|failed|assert|rel" | head -6
done
timeout 300 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
    --kernels auto --warmup 2 --reps 4 --gc manual --profile > "$OUT/step_profile.json" 2> "$OUT/step.err"
tail -3 "$OUT/step.err"
