#!/usr/bin/env bash
# Session 12, call 4 (final code): GPU tests of the attention (intervals, readable rows), the fused KV write, the
# routing kernel and the rollout; the attention micro-benchmark at aligned / unaligned T with the 16-aligned load
# bound; end to end with compiled layers (bf16 vs fp4f), and left-padded rows read as intervals.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 180 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/gpu/test_kv_attention_gpu.py \
    tests/gpu/test_kv_write_gpu.py tests/gpu/test_rollout_gpu.py tests/gpu/test_moe_routing_gpu.py \
    tests/kernels/test_kv_attention.py tests/kernels/test_kv_write.py 2>&1 | grep -E "passed|failed|FAILED|assert|Error" | head -30
timeout 90 python3 benchmarks/bench_decode_attn.py --batches 8,64 --lengths 8193,32769,32768 --alt --mask \
    > "$OUT/decode_attn_rows.jsonl" 2> "$OUT/decode_attn_rows.err"; tail -2 "$OUT/decode_attn_rows.err"
python3 benchmarks/summarize_rows.py fast "$OUT/decode_attn_rows.jsonl"
TORCHDYNAMO_DISABLE=0 timeout 150 python3 benchmarks/bench_decode.py --modes bf16,fp4f --batches 8,64 \
    --lengths 8192,32768 --profile --profile-top 40 --compile layers --budget-s 120 \
    --out "$OUT/decode_final.jsonl" > /dev/null 2> "$OUT/decode_final.err"
tail -2 "$OUT/decode_final.err"; python3 benchmarks/summarize_rows.py decode "$OUT/decode_final.jsonl"
TORCHDYNAMO_DISABLE=0 timeout 90 python3 benchmarks/bench_decode.py --modes fp4f --batches 8,64 --lengths 32768 \
    --left-pad 0.5 --masks interval --no-graph --profile --compile layers --budget-s 70 \
    --out "$OUT/decode_pad_final.jsonl" > /dev/null 2> "$OUT/decode_pad_final.err"
tail -2 "$OUT/decode_pad_final.err"; python3 benchmarks/summarize_rows.py decode "$OUT/decode_pad_final.jsonl"
