#!/usr/bin/env bash
# Session 12, call 3: the one-launch MoE routing kernel (GPU tests, bench_routing, end to end with compiled layers)
# and whether the decode attention is slower at a context not divisible by 16 (8193 / 32769 vs 8192 / 32768).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 6 -rf --tb=short tests/gpu/test_moe_routing_gpu.py \
    tests/kernels/test_moe_routing.py tests/gpu/test_rollout_gpu.py 2>&1 | grep -E "passed|failed|FAILED|assert|Error" | head -30
timeout 60 python3 benchmarks/bench_routing.py > "$OUT/routing.jsonl" 2> "$OUT/routing.err"; tail -2 "$OUT/routing.err"
cat "$OUT/routing.jsonl" | cut -c1-400
timeout 120 python3 benchmarks/bench_decode_attn.py --batches 8,64 --lengths 8192,8193,32768,32769 --alt --mask \
    > "$OUT/decode_attn_align.jsonl" 2> "$OUT/decode_attn_align.err"; tail -2 "$OUT/decode_attn_align.err"
python3 benchmarks/summarize_rows.py fast "$OUT/decode_attn_align.jsonl"
TORCHDYNAMO_DISABLE=0 timeout 120 python3 benchmarks/bench_decode.py --modes bf16,fp4f --batches 8,64 \
    --lengths 8192 --profile --profile-top 40 --compile layers --budget-s 90 \
    --out "$OUT/decode_routing.jsonl" > /dev/null 2> "$OUT/decode_routing.err"
tail -2 "$OUT/decode_routing.err"
python3 benchmarks/summarize_rows.py decode "$OUT/decode_routing.jsonl"
