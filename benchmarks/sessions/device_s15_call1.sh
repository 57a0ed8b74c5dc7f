#!/usr/bin/env bash
# (As run. Its --k-slices auto|off option of bench_static_decode.py became --gemm-grid auto|full in call 2.)
# Session 15, call 1: the GPU tests of what landed unmeasured in session 14 (the decode attention's combine up to 256
# splits in one step, the static K/V write as one quantize at the device row) and of the W4A16 GEMM's K slices
# (new: moe_slices), then the GEMM under random routing at batch 1-32 (BN 32 / 64 configs, BT 16 with 2-8 K slices,
# the default), then FP4 decode at batch 1 / 8, 8K, with K slices auto vs off (graphs, compiled layers).
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/gpu/test_kv_attention_gpu.py \
    tests/kernels/test_kv_attention.py tests/gpu/test_rollout_gpu.py tests/gpu/test_kv_write_gpu.py \
    tests/kernels/test_kv_write.py tests/kernels/test_moe_triton.py tests/kernels/test_moe_slices.py 2>&1 \
    | grep -E "passed|failed|FAILED|assert|Error" | head -20
timeout 150 python3 benchmarks/bench_moe_skew.py --shapes qwen3_fc1,qwen3_fc2 --batches 1,2,4,8,16,32 \
    > "$OUT/moe_skew.jsonl" 2> "$OUT/moe_skew.err"; tail -1 "$OUT/moe_skew.err"
cut -c1-900 "$OUT/moe_skew.jsonl"
export TORCHDYNAMO_DISABLE=0
for ks in auto off; do
  timeout 80 python3 benchmarks/bench_static_decode.py --shape qwen3-30b-a3b --modes fp4 --batches 1,8 \
      --prompts 8192 --steps 24 --compile layers --graph-only --k-slices $ks > "$OUT/decode_b1_b8_$ks.jsonl" \
      2> "$OUT/decode_b1_b8_$ks.err"
  tail -1 "$OUT/decode_b1_b8_$ks.err"; cut -c1-220 "$OUT/decode_b1_b8_$ks.jsonl"
done
