#!/usr/bin/env bash
# Session 12, call 5: the GPU tests that call 4's 180 s limit cut off (fused KV write, readable rows, rollout),
# split so that each part reports; one attention point with intervals and readable rows at an aligned T.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/gpu/test_kv_write_gpu.py \
    tests/gpu/test_kv_attention_gpu.py tests/gpu/test_moe_routing_gpu.py 2>&1 | grep -E "passed|failed|FAILED|assert|Error" | head -20
timeout 130 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/gpu/test_rollout_gpu.py \
    tests/kernels/test_kv_write.py 2>&1 | grep -E "passed|failed|FAILED|assert|Error" | head -20
timeout 50 python3 benchmarks/bench_decode_attn.py --batches 64 --lengths 32768 --alt --mask > "$OUT/attn.jsonl" 2>/dev/null
python3 benchmarks/summarize_rows.py fast "$OUT/attn.jsonl"
