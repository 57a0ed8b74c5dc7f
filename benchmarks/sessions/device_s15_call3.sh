#!/usr/bin/env bash
# (As run, but for the GEMM summary: an inline snippet then, `summarize_rows.py skew` since, the same lines.)
# Session 15, call 3: the final GEMM launch rule (compact grid only when at most 1/8 of the experts have tokens; K
# slices to 4 programs per multiprocessor): the decode curve's batch 1 / 8 points at 8K, BF16 vs FP4 (graphs,
# compiled layers; session 14's call 6 points), the GEMM under random routing at batch 1/2/4, and the relaxed int64
# test (the kernels are call 2's, whose GPU tests passed but that one).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
export TORCHDYNAMO_DISABLE=0
timeout 120 python3 benchmarks/bench_static_decode.py --shape qwen3-30b-a3b --modes bf16,fp4 --batches 1,8 \
    --prompts 8192 --steps 24 --compile layers --graph-only > "$OUT/decode_curve_b1_b8.jsonl" \
    2> "$OUT/decode_curve_b1_b8.err"
tail -1 "$OUT/decode_curve_b1_b8.err"; cut -c1-240 "$OUT/decode_curve_b1_b8.jsonl"
export TORCHDYNAMO_DISABLE=1
timeout 60 python3 benchmarks/bench_moe_skew.py --shapes qwen3_fc1,qwen3_fc2 --batches 1,2,4 \
    > "$OUT/moe_skew.jsonl" 2> "$OUT/moe_skew.err"; tail -1 "$OUT/moe_skew.err"
python3 benchmarks/summarize_rows.py skew "$OUT/moe_skew.jsonl"
timeout 30 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/kernels/test_moe_triton.py -k int64 2>&1 \
    | grep -E "passed|failed|FAILED|assert|Error" | head
