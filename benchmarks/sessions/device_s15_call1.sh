#!/usr/bin/env bash
# Next session, first call (written in session 14, not run): the decode attention's combine as landed (one step up
# to 256 splits, steps of 256 beyond; session 14's call 6 ran steps of 32) and the static K/V write as one quantize
# at the device row (fused.quantize(out_row=)) in the GPU tests and at batch 1 / 8 of
# the curve (graphs, compiled layers), then the W4A16 GEMM at batch 1-16 with BN 32 / 64 configs under random
# routing (few active experts: too few programs at BN 128).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 180 python3 -m pytest -q -p no:cacheprovider -n 6 -rf --tb=short tests/gpu/test_kv_attention_gpu.py \
    tests/kernels/test_kv_attention.py tests/gpu/test_rollout_gpu.py tests/gpu/test_kv_write_gpu.py \
    tests/kernels/test_kv_write.py 2>&1 | grep -E "passed|failed|FAILED|assert|Error" | head
export TORCHDYNAMO_DISABLE=0
timeout 200 python3 benchmarks/bench_static_decode.py --shape qwen3-30b-a3b --modes bf16,fp4 --batches 1,8 \
    --prompts 1024,8192,32768 --steps 24 --compile layers --graph-only > "$OUT/decode_curve_b1.jsonl" \
    2> "$OUT/decode_curve_b1.err"
tail -1 "$OUT/decode_curve_b1.err"; cut -c1-220 "$OUT/decode_curve_b1.jsonl"
export TORCHDYNAMO_DISABLE=1
timeout 120 python3 benchmarks/bench_moe_skew.py --shapes qwen3_fc1,qwen3_fc2 --batches 1,2,4,8,16 \
    > "$OUT/moe_skew.jsonl" 2> "$OUT/moe_skew.err"; tail -1 "$OUT/moe_skew.err"; cut -c1-420 "$OUT/moe_skew.jsonl"
