#!/usr/bin/env bash
# Session 13, call 2: the GPU tests of K/V sites recorded from the cache's stored history (no per-step record
# copy), then end to end at the Qwen3-30B-A3B decoder-layer shape (4 layers, 128 experts top-8), bf16 vs fp4f.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/gpu/test_kv_write_gpu.py \
    tests/gpu/test_rollout_gpu.py 2>&1 | grep -E "passed|failed|FAILED|assert|Error" | head -30
TORCHDYNAMO_DISABLE=0 timeout 240 python3 benchmarks/bench_decode.py --shape qwen3-30b-a3b --modes bf16,fp4f \
    --batches 8,64 --lengths 8192,32768 --profile --profile-top 40 --compile layers --budget-s 200 \
    --out "$OUT/decode_qwen3_30b.jsonl" > /dev/null 2> "$OUT/decode_qwen3_30b.err"
tail -2 "$OUT/decode_qwen3_30b.err"; python3 benchmarks/summarize_rows.py decode "$OUT/decode_qwen3_30b.jsonl"
