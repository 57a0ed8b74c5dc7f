#!/usr/bin/env bash
# Session 30, call 5: the decode curve at the current code (the packed CUDA GEMM of session 26 at decode sizes, the
# kernels of sessions 27-29; last full run at 32K: session 16): graph-replayed steps of the Qwen3-30B-A3B-shaped
# 4-layer model, BF16 vs FP4, batch 1 / 8 / 64 at 1K, 8K and 32K context.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
export TORCHDYNAMO_DISABLE=0
timeout 540 python3 benchmarks/bench_static_decode.py --shape qwen3-30b-a3b --modes bf16,fp4 --batches 1,8,64 \
    --prompts 1024,8192,32768 --steps 24 --compile layers --graph-only > "$OUT/decode_curve.jsonl" \
    2> "$OUT/decode_curve.err"
echo "rc=$?"; tail -3 "$OUT/decode_curve.err"; cut -c1-240 "$OUT/decode_curve.jsonl"
