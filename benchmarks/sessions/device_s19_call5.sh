#!/usr/bin/env bash
# Session 19, call 5 (run inline, warm): the training step, BF16 vs plain FP4 QAT vs TRACE guided, at the
# Qwen3-30B-A3B layer shape (one micro-batch), at this session's kernels.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 200 python3 benchmarks/bench_qat_step.py --preset qwen3-30b-a3b --variants bf16_grouped,fp4_qat,trace_guided \
    --kernels auto --warmup 2 --reps 8 --gc manual > "$OUT/qat_step.json" 2> "$OUT/qat_step.err"
tail -3 "$OUT/qat_step.err"; tail -c 900 "$OUT/qat_step.json"
