#!/usr/bin/env bash
# Session 13, call 6 (final code): the GEMM tests on CUDA (the new 32-token row), then end to end on the default
# model, bf16 vs fp4f at 8K, with the GEMM config for the busiest expert (moe_triton.BUSIEST_EXPERT).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 60 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/kernels/test_moe_triton.py 2>&1 \
    | grep -E "passed|failed|FAILED|assert|Error" | head -20
TORCHDYNAMO_DISABLE=0 timeout 120 python3 benchmarks/bench_decode.py --modes bf16,fp4f --batches 64,8 --lengths 8192 \
    --profile --profile-top 40 --compile layers --no-graph --budget-s 105 \
    --out "$OUT/decode_busiest.jsonl" > /dev/null 2> "$OUT/decode_busiest.err"
tail -1 "$OUT/decode_busiest.err"; python3 benchmarks/summarize_rows.py decode "$OUT/decode_busiest.jsonl"
