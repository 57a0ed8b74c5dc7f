#!/usr/bin/env bash
# Session 14, call 4: the GPU tests of what changed (static_decode "auto" = graph on CUDA, the dense attention, the
# GEMM's int64 offsets), then the decode curve with graphs and compiled layers at the Qwen3-30B-A3B shape: batch
# 1..64 x context 1K / 8K / 32K, BF16 vs FP4 (graph replays only).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 210 python3 -m pytest -q -p no:cacheprovider -n 6 -rf --tb=short tests/gpu/test_rollout_gpu.py \
    tests/gpu/test_kv_attention_gpu.py tests/kernels/test_kv_attention_dense.py tests/kernels/test_moe_triton.py \
    2>&1 | grep -E "passed|failed|FAILED|assert|Error" | head -20
export TORCHDYNAMO_DISABLE=0
timeout 330 python3 benchmarks/bench_static_decode.py --shape qwen3-30b-a3b --modes bf16,fp4 --batches 1,8,32,64 \
    --prompts 1024,8192,32768 --steps 24 --compile layers --graph-only > "$OUT/decode_curve.jsonl" \
    2> "$OUT/decode_curve.err"
tail -2 "$OUT/decode_curve.err"; cut -c1-220 "$OUT/decode_curve.jsonl"
