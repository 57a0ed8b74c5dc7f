#!/usr/bin/env bash
# Session 14, call 6 (call 5: benchmarks/profile_static_step.py --modes bf16,fp4 --batches 1 --prompts 1024,8192):
# the split cap (MAX_FAST_SPLITS) and the combine in steps of 32 splits: the decode attention GPU tests, then the
# batch 1 / 8 points of the curve at 8K / 32K again (graphs, compiled layers).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 100 python3 -m pytest -q -p no:cacheprovider -n 6 -rf --tb=short tests/gpu/test_kv_attention_gpu.py \
    tests/kernels/test_kv_attention.py 2>&1 | grep -E "passed|failed|FAILED|assert|Error" | head
export TORCHDYNAMO_DISABLE=0
timeout 170 python3 benchmarks/bench_static_decode.py --shape qwen3-30b-a3b --modes bf16,fp4 --batches 1,8 \
    --prompts 8192,32768 --steps 24 --compile layers --graph-only > "$OUT/decode_curve_b1.jsonl" \
    2> "$OUT/decode_curve_b1.err"
tail -1 "$OUT/decode_curve_b1.err"; cut -c1-220 "$OUT/decode_curve_b1.jsonl"
